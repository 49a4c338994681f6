"""The ``slipstream serve`` options that ``--ray`` does not honour, refused at start.

Under Ray, requests reach the replicas through Ray Serve's HTTP proxy, not Slipstream's
front end: what that front end adds (API keys, client certificates, the access log,
request tracing, asynchronous jobs) is not there, and a replica may run on another host
than the client's shared memory. Starting anyway would serve without what the option
asked for (an open server where keys were asked for, any client where certificates
were), so each such option given is an error naming what to do instead. TLS itself
(``--tls-cert/--tls-key``) is the proxy's: :func:`slipstream.rayserve.app.http_options`.
A model whose config does not read stops the start before Ray starts
(:func:`unreadable_configs`): a stateful model on more than one replica among them.

    >>> from pathlib import Path
    >>> from slipstream.config import ServerSettings
    >>> refused_options(ServerSettings(model_repository=Path("."), access_log=True))[0][:43]
    '--access-log is not served under --ray: Ray'
"""

from __future__ import annotations

from collections.abc import Callable

from slipstream.config import ConfigError, ServerSettings
from slipstream.repository.layout import list_models, read_config

NO_GRPC = (
    "gRPC is not served under --ray (Ray Serve's gRPC proxy routes by an application "
    "name each call must carry, and has no bidirectional streams for ModelStreamInfer): "
    "use the HTTP port, or slipstream serve without --ray for gRPC"
)
# Option -> (whether it was given, why it is refused and what to do instead).
_REFUSED: dict[str, tuple[Callable[[ServerSettings], bool], str]] = {
    "--auth-file": (
        lambda s: s.auth_file is not None,
        "Ray Serve's HTTP proxy checks no API key, so every route would be open; put an "
        "authenticating proxy in front of Ray Serve, or serve without --ray",
    ),
    "--tls-client-ca": (
        lambda s: s.tls_client_ca is not None,
        "Ray Serve's HTTP proxy serves TLS (--tls-cert/--tls-key) but asks no client for a "
        "certificate, so every client would be let in; check client certificates in front "
        "of it (an ingress or load balancer), or serve without --ray",
    ),
    "--jobs-redis": (
        lambda s: bool(s.jobs_redis),
        "asynchronous jobs run on slipstream serve and slipstream worker; serve them without --ray",
    ),
    "--trace-config": (
        lambda s: bool(s.trace_config),
        "the replicas export no spans; trace requests with slipstream serve without --ray",
    ),
    "--access-log": (
        lambda s: s.access_log,
        "Ray Serve's proxy writes its own access log (the proxy log in Ray's session "
        "logs directory); leave --access-log out",
    ),
    "--allow-client-shm": (
        lambda s: s.allow_client_shm,
        "a model's replicas run in processes of their own, on any Ray node, where a "
        "client's shared memory region is not; send the tensors in the requests",
    ),
    "--price-per-hour": (
        lambda s: s.price_per_hour is not None,
        "the cost gauges are kept by slipstream serve's own process; leave it out",
    ),
    "--trace-startup": (
        lambda s: s.trace_startup is not None,
        "each replica starts in a Ray worker of its own; trace a start without --ray",
    ),
}


def unreadable_configs(settings: ServerSettings) -> list[str]:
    """One message for each model whose config does not read (none: []): ``serve --ray``
    deploys every model of the repository at start, and one it cannot would stop it once
    Ray had started. A stateful model (``sequence_batching:``) on more than one replica
    is one (:class:`slipstream.config.ModelConfig`'s check): Ray Serve routes each
    request on its own, not by the sequence id in its body."""
    problems = []
    for name, directory in list_models(settings.model_repository).items():
        try:
            read_config(directory)
        except (ConfigError, OSError) as exc:
            problems.append(f"model {name!r} cannot be deployed: {exc}")
    return problems


def refused_options(settings: ServerSettings) -> list[str]:
    """One message for each option given that ``--ray`` does not honour (none: [])."""
    return [
        f"{option} is not served under --ray: {reason}"
        for option, (given, reason) in _REFUSED.items()
        if given(settings)
    ]
