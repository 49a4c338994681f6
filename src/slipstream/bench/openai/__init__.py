"""OpenAI mode of ``slipstream bench`` (``--protocol openai-chat`` or ``openai-completions``):
a fixed number of streamed requests per level, timed for TTFT, TPOT, ITL and end to end."""
