"""``serve --ray``'s statistics: every replica's figures of a model version summed, as
one server that ran all their requests would report them (``GET /v2/models/stats``)."""

from __future__ import annotations

from typing import Any

from slipstream.observability.stats import ModelStatsRecorder
from slipstream.protocol.v2_meta import model_stats_json
from slipstream.rayserve.control import merge_stats
from slipstream.types import MemoryUsage


def _replica(responses: int, memory: list[MemoryUsage]) -> dict[str, Any]:
    """One replica's report of model m version 1: ``responses`` requests of a decoupled
    model, each answered twice (5 ns, then 3 ns), holding ``memory``."""
    recorder = ModelStatsRecorder("m", "1")
    recorder.set_memory_usage(memory)
    for _ in range(responses):
        recorder.record_response(0, outcome="success", start_ns=0, output_start_ns=4, end_ns=5)
        recorder.record_response(1, outcome="empty", start_ns=5, end_ns=8)
    entry: dict[str, Any] = model_stats_json([recorder.snapshot()])["model_stats"][0]
    return entry


def test_response_stats_and_memory_usage_add_up_across_replicas() -> None:
    first = _replica(2, [MemoryUsage("CPU", 0, 100)])
    second = _replica(3, [MemoryUsage("GPU", 0, 40), MemoryUsage("CPU", 0, 10)])
    [merged] = merge_stats([first, second])
    responses = merged["response_stats"]
    assert responses["0"]["success"] == {"count": 5, "ns": 5 * 5}
    assert responses["0"]["compute_output"] == {"count": 5, "ns": 5 * 1}
    assert responses["1"]["empty_response"] == {"count": 5, "ns": 5 * 3}
    assert merged["memory_usage"] == [{"type": "CPU", "id": 0, "byte_size": 110},
                                      {"type": "GPU", "id": 0, "byte_size": 40}]  # fmt: skip


def test_a_response_index_only_one_replica_reached_is_kept() -> None:
    quiet = _replica(0, [])
    [merged] = merge_stats([quiet, _replica(1, [])])
    assert merged["response_stats"]["1"]["empty_response"] == {"count": 1, "ns": 3}
    assert merged["memory_usage"] == []
