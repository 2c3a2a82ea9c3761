"""What each command does, one module each (train, val, predict, plan), and torchrun started for several devices.
Above everything but the API and the CLI, which call it.
"""
