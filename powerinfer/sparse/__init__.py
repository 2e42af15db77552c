"""Sparse computation: input-sparse linears on column layouts (columns.py); TEAL-style sites,
calibration and allocation of their thresholds (sites.py, calibrate.py, allocate.py)."""
