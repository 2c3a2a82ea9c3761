"""Evaluating a model: validation with Ultralytics' metrics, and the pictures a run draws."""
