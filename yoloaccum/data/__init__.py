"""The data's path into training: dataset YAMLs and Ultralytics' datasets, the synthetic shapes set, the
seed-ordered loader and multi-scale resizing.
"""
