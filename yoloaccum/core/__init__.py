"""The accumulation core, independent of detection: the schedule's arithmetic (accumulate, windows, lr, decay), the
window normaliser, the engine that runs micro-steps and one optimizer step per window, and its out-of-memory
back-off. Uses only config, process and distributed.
"""
