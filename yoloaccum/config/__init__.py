"""The configuration: cfg/default.yaml's keys as a schema and a typed view, loaded, merged and validated into one
immutable Config; the Ultralytics keys yoloaccum does not take; `device=` parsed without torch; the Config as
Ultralytics' args. At the bottom: it imports nothing of yoloaccum's but errors.
"""
