"""Metrics, the V2 statistics extension, and logging helpers."""
