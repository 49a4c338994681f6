"""``--cache``: the response cache's one-string spec, parsed."""

from __future__ import annotations

_SIZE_UNITS = {"": 1, "B": 1, "KB": 1000, "MB": 1000**2, "GB": 1000**3,
               "KIB": 1024, "MIB": 1024**2, "GIB": 1024**3}  # fmt: skip


def parse_cache_spec(spec: str) -> tuple[str, int, str, int]:
    """``--cache`` as (kind, size_bytes, redis_url, ttl_s); ValueError naming the fix.

    >>> parse_cache_spec("local:size=256MB")
    ('local', 256000000, '', 0)
    >>> parse_cache_spec("redis://127.0.0.1:6379?ttl=600")
    ('redis', 0, 'redis://127.0.0.1:6379', 600)
    """
    if spec.startswith("local"):
        options = dict(
            item.split("=", 1) for item in spec.removeprefix("local").lstrip(":").split(",")
            if "=" in item
        )  # fmt: skip
        size = options.pop("size", "256MB").strip().upper()
        number = size.rstrip("KMGIB")
        if options or not number.isdigit() or size[len(number) :] not in _SIZE_UNITS:
            raise ValueError(f"expected local:size=<bytes>[KB|MB|GB], e.g. local:size=256MB, "
                             f"got {spec!r}")  # fmt: skip
        size_bytes = int(number) * _SIZE_UNITS[size[len(number) :]]
        if size_bytes < 1024:
            raise ValueError(f"local cache size {size_bytes} B: at least 1KB")
        return "local", size_bytes, "", 0
    if spec.startswith(("redis://", "rediss://")):  # rediss: Redis over TLS
        url, _, query = spec.partition("?")
        ttl = 0
        for item in filter(None, query.split("&")):
            key, _, value = item.partition("=")
            if key != "ttl" or not value.isdigit():
                raise ValueError(f"redis cache option {item!r}: only ttl=<seconds> is known")
            ttl = int(value)
        return "redis", 0, url, ttl
    raise ValueError(f"expected local:size=256MB or redis[s]://host:port[?ttl=600], got {spec!r}")
