"""The process boundary of the split layout (``slipstream serve --frontends N``).

Only this package knows that the front ends and the serving core can live in different
processes: :mod:`~slipstream.engine.remote` gives the front ends the same
``InferenceService`` contract the in-process core implements, answered by an engine
process through :mod:`~slipstream.engine.client` and :mod:`~slipstream.engine.host`
(a Unix socket, batched per loop turn by :mod:`~slipstream.engine.channel`, pickle 5 with the
tensors out of band: :mod:`~slipstream.engine.wire`);
:mod:`~slipstream.engine.supervisor` starts, restarts and stops the processes. What runs
in each process is composed in ``server/split.py``.
"""
