"""The shared measurement core of ``slipstream bench``: load levels and common settings,
the load driver (open and closed loops), latency histograms, HTTP keep-alive
connections, errors and output. The V2 and OpenAI modes import it, never each other."""
