"""The front door: API keys and roles, per-key rate limits, request ids and the access log."""
