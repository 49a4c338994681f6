"""Slipstream: a fast inference server for the Open Inference Protocol (V2)."""

__version__ = "0.1.0"
