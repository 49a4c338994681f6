"""``slipstream bench``: load generators for V2 and OpenAI-compatible inference servers."""
