"""`python -m yoloaccum ...`, which is also how torchrun starts each rank."""

from yoloaccum.cli import run

run()
