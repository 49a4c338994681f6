"""The shared measurement core of ``slipstream bench``: load levels, arrival scheduling,
latency histograms, HTTP keep-alive connections, process sampling, errors and output."""
