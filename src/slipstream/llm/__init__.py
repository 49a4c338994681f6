"""Generative models: an :class:`~slipstream.llm.engine.Engine` contract, the
transformers engine (continuous batching over a paged KV cache), and the service that
turns OpenAI-style requests into token streams."""
