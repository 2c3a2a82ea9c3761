"""BatchNorm's statistics beyond Ultralytics': bn=window (each window's statistics from a pass over its images) and
precise_bn (the EMA's statistics recomputed before validation).
"""
