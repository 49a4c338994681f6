"""Model monitoring off the hot path: drift detection against a reference."""
