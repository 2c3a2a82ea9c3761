"""The detector: built from YAML or weights, layers frozen, checkpoints read and written, the micro-batch measured
from memory (batch=-1), the forward compiled (compile=).
"""
