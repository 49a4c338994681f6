"""Queues and dynamic batching, one per loaded model version."""
