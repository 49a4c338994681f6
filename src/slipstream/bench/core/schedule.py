"""Open-loop arrival scheduling shared by both bench modes: when to send, and how a
late send's latency is counted."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

# Open loop: a send this close to its scheduled time goes now. Event-loop timers wake up
# to ~1 ms late (epoll and libuv timeouts are whole milliseconds); sending up to that
# much early, and counting its latency from the actual send, keeps timer slack out of
# the measured latency.
EARLY_SEND_S = 0.001


def arrival_gaps_s(
    rate_per_s: float, distribution: str, rng: np.random.Generator, chunk: int = 4096
) -> Iterator[float]:
    """Gaps between scheduled sends of an open loop: constant ``1/rate``, or exponential
    with that mean (a Poisson process). Drawn ``chunk`` at a time: one numpy call per
    4096 sends instead of one per send.
    """
    mean_gap_s = 1.0 / rate_per_s
    if distribution == "constant":
        while True:
            yield mean_gap_s
    if distribution != "poisson":
        raise ValueError(f"distribution: expected constant or poisson, got {distribution!r}")
    while True:
        yield from rng.exponential(mean_gap_s, size=chunk).tolist()


def corrected_latency_s(scheduled_s: float, sent_s: float, done_s: float) -> float:
    """Latency of an open-loop request, corrected for coordinated omission.

    A request the client could not send on time (every connection busy, or its event
    loop late) still counts from when it *should* have been sent: the wait is what a
    user arriving at that moment would see. One sent early (timer slack) counts from
    when it was actually sent.

    >>> corrected_latency_s(scheduled_s=1.0, sent_s=1.5, done_s=1.75)
    0.75
    """
    return done_s - min(scheduled_s, sent_s)
