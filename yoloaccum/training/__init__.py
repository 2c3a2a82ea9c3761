"""The run: its parts built in order, the epoch loop over the engine, the end-of-epoch steps (validation, logs,
early stopping, saving), last.pt's state from its parts, the run folder and resume.
"""
