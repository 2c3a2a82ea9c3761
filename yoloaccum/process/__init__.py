"""What a run does to its process: seeds and random states (saved and put back on resume), memory settings, signals,
and the global settings a run changes, put back when it returns. Below everything that trains.
"""
