"""Several processes as one run: the process group, DDP's wrapper and its once-a-window synchronisation, the
collectives every rank calls, and torchrun's restarts. Knows nothing of training.
"""
