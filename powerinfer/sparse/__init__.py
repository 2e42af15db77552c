"""Input-sparse (TEAL-style) computation: sites, calibration, allocation."""
