"""The state the model manager (serving/manager.py) keeps about each model, and the rules
comparing versions, apart from the manager so that its module holds how the state changes."""

from __future__ import annotations

from dataclasses import dataclass, field

from slipstream.config import ModelConfig
from slipstream.errors import Unavailable
from slipstream.repository.changes import ModelFingerprint
from slipstream.serving.model import ModelVersion
from slipstream.types import ModelMetadata, RepositoryEntry


@dataclass(slots=True)
class ModelState:
    """Everything known about one model of the repository."""

    name: str
    # Serving versions by number. A reload builds a new dict and assigns it in one step,
    # so a request routes on either the old set or the new one, never a mix.
    versions: dict[int, ModelVersion] = field(default_factory=dict)
    # Why the last load attempt failed, by version (0: the whole model, e.g. its config).
    failures: dict[int, str] = field(default_factory=dict)
    # The last attempt failed and ``versions`` kept serving what was loaded before it.
    kept_previous: bool = False
    # LOADING / UNLOADING while a change is in progress, else "".
    transition: str = ""
    # The files ``versions`` were loaded from; None when nothing is loaded.
    loaded: ModelFingerprint | None = None
    # The files the last load attempt saw, whatever its outcome: unchanged files are
    # not tried again (a second concurrent load, a poll after a failure).
    attempted: ModelFingerprint | None = None
    # Load attempts finished, so a load that waited for another can tell one ran.
    attempts: int = 0
    # Unloaded for being idle (see serving/idle.py): the next request loads it again.
    # What its versions were, so metadata is answered without loading them.
    asleep: bool = False
    sleeping: dict[int, tuple[ModelMetadata, ModelConfig]] = field(default_factory=dict)
    # A wake-up load that failed is not tried again before ``retry_at`` (monotonic s);
    # each failure in a row doubles the wait, up to manager.py's _MAX_BACKOFF_S.
    retry_at: float = 0.0
    failed_wakes: int = 0
    # Versions that served and were unloaded since (by request, a reload that dropped
    # them, an idle unload): the index lists them UNAVAILABLE, reason "unloaded", as
    # Triton does, until they serve again.
    unloaded: set[int] = field(default_factory=set)
    # The config a load request carried (Triton's load with a config override), used in
    # place of the repository's until a load without one, or an unload.
    override: ModelConfig | None = None


class ModelAsleep(Unavailable):
    """The model was unloaded for being idle; :meth:`ModelManager.wake` loads it again."""

    def __init__(self, name: str) -> None:
        super().__init__(f"model {name!r} is loading after being idle", retry_after_s=1)
        self.name = name


def index_entries(state: ModelState, failures: str, ready_only: bool) -> list[RepositoryEntry]:
    """``state``'s lines in the repository index (``failures``: why its last load failed,
    as :meth:`ModelManager.failures` words it)."""
    name = state.name
    if state.asleep and not state.versions and not state.transition:
        if ready_only:
            return []
        why = failures or "idle"
        return [RepositoryEntry(name, str(v), "UNAVAILABLE", why) for v in sorted(state.sleeping)]
    entries = []
    for number in sorted(state.versions):
        # A version whose files failed to reload serves its earlier files.
        reason = state.failures.get(number, "")
        if reason:
            reason = f"serving the files loaded before; reloading failed: {reason}"
        entries.append(RepositoryEntry(name, str(number), "READY", reason))
    if ready_only:
        return entries
    for number, reason in sorted(state.failures.items()):
        if number not in state.versions:
            entries.append(RepositoryEntry(name, str(number or ""), "UNAVAILABLE", reason))
    if state.transition and not state.versions:  # LOADING or UNLOADING says it all
        entries.append(RepositoryEntry(name, "", state.transition, ""))
    else:
        for number in sorted(state.unloaded - set(state.versions) - set(state.failures)):
            entries.append(RepositoryEntry(name, str(number), "UNAVAILABLE", "unloaded"))
    if not entries:
        entries.append(RepositoryEntry(name, "", "", ""))
    return entries


def signature_change(serving: ModelConfig, new: ModelConfig) -> str:
    """How ``new``'s input/output names or datatypes differ from ``serving``'s; "" if not.

    Shapes may change (a fixed dim becoming -1 breaks no client); a renamed, added,
    removed or retyped tensor breaks the clients of the serving version.
    """
    problems = []
    for kind, old, now in (
        ("input", serving.input, new.input),
        ("output", serving.output, new.output),
    ):
        before = {t.name: t.data_type for t in old}
        after = {t.name: t.data_type for t in now}
        for tensor in sorted(set(before) | set(after)):
            if tensor not in after:
                problems.append(f"{kind} {tensor!r} is gone")
            elif tensor not in before:
                problems.append(f"{kind} {tensor!r} is new")
            elif before[tensor] != after[tensor]:
                problems.append(f"{kind} {tensor!r} is {after[tensor]}, was {before[tensor]}")
    return ", ".join(problems)


def files_unchanged(loaded: ModelFingerprint | None, found: ModelFingerprint, version: int) -> bool:
    """Whether a serving version's files and the config are as they were loaded."""
    return (
        loaded is not None
        and loaded.config == found.config
        and loaded.version(version) == found.version(version)
    )
