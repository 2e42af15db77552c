"""Sparse computation: input-sparse linears on column layouts (columns.py)."""
