"""``slipstream bench``: a load generator and profiler for Open Inference Protocol servers."""
