"""Asynchronous inference on a Redis stream: the queue the server submits jobs to and
``slipstream worker`` processes consume (see :mod:`slipstream.jobs.queue`)."""
