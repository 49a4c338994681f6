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

Whether waiting pays is learnt, too. Under a closed loop (clients that send again as soon
as they are answered) the company comes within the hold. Under requests that arrive on
their own schedule (Poisson, 200 a second on `mlp`) two are often in flight at once, yet
the next rarely comes within a millisecond, and every lone request waited out the hold:
the median latency went from 1.2-1.7 to 2.3 ms. So the rule keeps a moving share of the
holds that another request joined (``JOINED_WEIGHT``); below one half it stops holding,
but for one request in ``PROBE_EVERY`` that could, which keeps the share up to date.

The rule knows nothing of the loop or the engine: the front end
(:class:`~slipstream.engine.remote.RemoteInferenceService`) tells it of each request
that arrives and each that is done, and asks it whether to wait.
"""

from __future__ import annotations

# The longest a lone request waits for company by default, and the span over which the
# front end remembers how many requests it held at once.
HOLD_S = 0.001
WINDOW_S = 0.05
# The weight of the last hold in the share of holds another request joined, and how
# often a request that could wait does while that share is below one half.
JOINED_WEIGHT = 0.125
PROBE_EVERY = 32


class Company:
    """Requests in flight in one front end, and the most it held at once lately."""

    __slots__ = (
        "_active", "_joined", "_passed", "_peak", "_peak_before", "_window", "most_s", "window_s",
    )  # fmt: skip

    def __init__(self, most_s: float = HOLD_S, window_s: float = WINDOW_S) -> None:
        if most_s < 0 or window_s <= 0:
            raise ValueError("most_s must be >= 0 and window_s > 0")
        self.most_s = most_s
        self.window_s = window_s
        self._active = 0
        self._peak = 0
        self._peak_before = 0
        self._window: int | None = None  # the number of the window of the last arrival
        self._joined = 1.0  # the moving share of holds another request joined
        self._passed = 0  # requests that could have waited but did not, since the last hold

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

    @property
    def joined_share(self) -> float:
        """The moving share of holds that another request joined."""
        return self._joined

    def expecting(self) -> bool:
        """Whether more requests are due soon: fewer are in flight than the peak."""
        return self.most_s > 0 and self._active < self.peak

    def should_hold(self) -> bool:
        """Whether a lone request should wait for company now: more are due, and holds
        have paid lately (or this one probes whether they would again)."""
        if not self.expecting():
            return False
        if self._joined >= 0.5:
            return True
        self._passed += 1
        if self._passed >= PROBE_EVERY:
            self._passed = 0
            return True
        return False

    def held(self, joined: bool) -> None:
        """A hold ended: ``joined`` when another request went with the held one."""
        self._joined += JOINED_WEIGHT * ((1.0 if joined else 0.0) - self._joined)
