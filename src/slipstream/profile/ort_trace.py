"""Reading ONNX Runtime's profiler trace: kernel time by operator type and by node."""

from __future__ import annotations

from typing import Any

from slipstream.profile.results import OpProfile, OpTime


def summarize_ort_trace(
    events: list[dict[str, Any]], skip_runs: int, top_n: int, batch_size: int
) -> OpProfile:
    """Aggregate an ORT profiler trace (its JSON list of events) by op type and by node.

    Node events named ``<node>_kernel_time`` carry the kernel's duration (``dur``, us)
    and its ``args.op_name``; ``model_run`` session events mark each run, so the first
    ``skip_runs`` runs (warm-up) are left out by timestamp.
    """
    runs = sorted(
        (e for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"),
        key=lambda e: int(e["ts"]),
    )[skip_runs:]
    cutoff_us = int(runs[0]["ts"]) if runs else float("inf")
    # name -> [op type, total us, calls]
    by_type: dict[str, list[Any]] = {}
    by_node: dict[str, list[Any]] = {}
    for event in events:
        name = str(event.get("name", ""))
        if event.get("cat") != "Node" or not name.endswith("_kernel_time"):
            continue
        if int(event["ts"]) >= cutoff_us:
            op_type = str(event.get("args", {}).get("op_name", "?"))
            node = name.removesuffix("_kernel_time")
            for table, key in ((by_type, op_type), (by_node, node)):
                row = table.setdefault(key, [op_type, 0.0, 0])
                row[1] += float(event.get("dur", 0))
                row[2] += 1
    kernel_us = sum(row[1] for row in by_type.values())
    count = max(1, len(runs))

    def top(table: dict[str, list[Any]]) -> tuple[OpTime, ...]:
        ranked = sorted(table.items(), key=lambda item: -float(item[1][1]))[:top_n]
        return tuple(
            OpTime(
                name=name,
                op_type=op_type,
                total_ms=total_us / 1000.0,
                ms_per_run=total_us / 1000.0 / count,
                calls=calls,
                share=total_us / kernel_us if kernel_us else 0.0,
            )
            for name, (op_type, total_us, calls) in ranked
        )

    return OpProfile(
        batch_size=batch_size,
        runs=len(runs),
        run_mean_ms=sum(float(e.get("dur", 0)) for e in runs) / 1000.0 / count,
        kernel_mean_ms=kernel_us / 1000.0 / count,
        top_ops=top(by_type),
        top_nodes=top(by_node),
    )
