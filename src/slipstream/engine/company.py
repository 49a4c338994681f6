"""When a front end's lone request waits for others before it leaves for the engine.

A front end sends the requests of one turn of its loop to the engine together
(:mod:`slipstream.engine.groups`). A gRPC front end (grpc.aio) takes one call from
grpc's queue per turn, so each of its calls used to leave alone, and on a core the two
processes share, the engine then wakes for each: measured with `mlp` at C=16, split
with one front end on one core, the engine spent 216 us of CPU per gRPC request against
34 us per HTTP request, whose turns hold many.

So a turn whose group is a single request may wait for company, as Nagle's algorithm
holds a small packet: it waits while the front end holds fewer requests in flight than
the most it held at once lately (``peak``: over this window of ``window_s`` and the one
before, windows counted from the clock's zero, so the last one to two ``window_s``), since
the clients behind those requests are about to send their next; it leaves as soon as
the front end holds as many again, and after ``most_s`` at the latest. A front end with
one client in flight (C=1) never waits: one request is as many as it ever holds.

The rule knows nothing of the loop or the engine: the front end
(:class:`~slipstream.engine.remote.RemoteInferenceService`) tells it of each request
that arrives and each that is done, and asks it whether to wait.
"""

from __future__ import annotations

# The longest a lone request waits for company by default, and the span over which the
# front end remembers how many requests it held at once.
HOLD_S = 0.001
WINDOW_S = 0.05


class Company:
    """Requests in flight in one front end, and the most it held at once lately."""

    __slots__ = ("_active", "_peak", "_peak_before", "_window", "most_s", "window_s")

    def __init__(self, most_s: float = HOLD_S, window_s: float = WINDOW_S) -> None:
        if most_s < 0 or window_s <= 0:
            raise ValueError("most_s must be >= 0 and window_s > 0")
        self.most_s = most_s
        self.window_s = window_s
        self._active = 0
        self._peak = 0
        self._peak_before = 0
        self._window: int | None = None  # the number of the window of the last arrival

    @property
    def active(self) -> int:
        """Requests that arrived and are not done."""
        return self._active

    @property
    def peak(self) -> int:
        """The most requests in flight at once over this window and the one before."""
        return max(self._peak, self._peak_before)

    def arrived(self, now: float) -> None:
        """A request arrived at ``now`` (seconds, any monotonic clock)."""
        self._active += 1
        window = int(now // self.window_s)
        if window != self._window:
            # The last arrival's window is the one before this, or long past.
            last = self._window
            self._peak_before = self._peak if last is not None and window == last + 1 else 0
            self._peak = 0
            self._window = window
        if self._active > self._peak:
            self._peak = self._active

    def done(self) -> None:
        """A request that arrived was answered, failed or given up on."""
        if self._active <= 0:
            raise RuntimeError("done() without a request in flight")
        self._active -= 1

    def expecting(self) -> bool:
        """Whether more requests are due soon: fewer are in flight than the peak."""
        return self.most_s > 0 and self._active < self.peak
