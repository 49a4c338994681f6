"""``--cpu-scheduling``: the split layout's processes under SCHED_BATCH (engine/supervisor.py).

Each case runs in a fresh interpreter: the policy is set on every thread of the process
that asks, which must not be pytest's own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="SCHED_BATCH is Linux's")

# A thread started before the call, the call, a thread started after it: every thread's
# policy, as the kernel reports it.
_PROGRAM = """
import json, os, sys, threading
from slipstream.engine.supervisor import set_cpu_scheduling
if sys.argv[2] != "normal":
    os.sched_setscheduler(0, getattr(os, sys.argv[2]), os.sched_param(0))
stop = threading.Event()
before = threading.Thread(target=stop.wait)
before.start()
set_cpu_scheduling(sys.argv[1])
after = threading.Thread(target=stop.wait)
after.start()
tids = [int(t) for t in os.listdir("/proc/self/task")]
print(json.dumps([os.sched_getscheduler(t) for t in tids]))
stop.set()
"""


def policies(policy: str, started_under: str = "normal") -> list[int]:
    done = subprocess.run(
        [sys.executable, "-c", _PROGRAM, policy, started_under],
        capture_output=True, text=True, check=True, timeout=60,
    )  # fmt: skip
    found: list[int] = json.loads(done.stdout)
    assert len(found) == 3, found  # the main thread and both others
    return found


def test_batch_puts_every_thread_under_sched_batch_those_started_before_included() -> None:
    assert policies("batch") == [os.SCHED_BATCH] * 3


def test_default_leaves_every_thread_under_the_normal_policy() -> None:
    assert policies("default") == [os.SCHED_OTHER] * 3


def test_a_process_its_operator_started_under_another_policy_keeps_it() -> None:
    assert policies("batch", started_under="SCHED_IDLE") == [os.SCHED_IDLE] * 3
