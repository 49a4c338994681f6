"""The rollout admin API from the tools' side: ``slipstream rollout`` and
``slipstream optimize --rollout`` call a running server's ``/v2/models/{m}/rollout``.

    status = rollout_request("http://127.0.0.1:8000", "mlp", {"action": "start",
                             "candidate": "2", "steps": [5, 25, 50, 100], "interval_s": 60})
    print(format_status(status))
"""

from __future__ import annotations

import re
import time
from typing import Any

import httpx

_DURATION = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(ms|s|m|h)?\s*$")
_UNIT_S = {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


class RolloutClientError(Exception):
    """The server refused, or could not be reached; the message says which and why."""


def parse_duration(text: str) -> float:
    """Seconds in ``60s``, ``2m``, ``500ms``, ``1h`` or a bare number of seconds."""
    match = _DURATION.match(text)
    if match is None or float(match.group(1)) <= 0:
        raise ValueError(f"{text!r}: expected a positive duration such as 60s, 2m or 500ms")
    return float(match.group(1)) * _UNIT_S[match.group(2) or "s"]


def rollout_request(
    url: str, model: str, body: dict[str, Any] | None = None, api_key: str = ""
) -> dict[str, Any]:
    """GET the model's rollout (``body`` None) or POST an action; the server's answer."""
    path = f"{url.rstrip('/')}/v2/models/{model}/rollout"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        if body is None:
            reply = httpx.get(path, headers=headers, timeout=30)
        else:
            reply = httpx.post(path, json=body, headers=headers, timeout=30)
    except httpx.HTTPError as exc:
        raise RolloutClientError(f"{path}: {exc}; is the server running there?") from None
    try:
        answer = reply.json()
    except ValueError:
        answer = {"error": reply.text}
    if reply.status_code != 200:
        raise RolloutClientError(f"{reply.status_code}: {answer.get('error', answer)}")
    if not isinstance(answer, dict):
        raise RolloutClientError(f"unexpected answer from {path}: {answer!r}")
    return answer


def format_status(status: dict[str, Any]) -> str:
    """A rollout's status and history as lines of text."""
    weights = ", ".join(f"v{v} {w:g}%" for v, w in status.get("weights", {}).items())
    lines = [f"model {status['model']}: {status['status']}" + (f" ({weights})" if weights else "")]
    if status["status"] == "none":
        return "\n".join(lines)
    plan = status["plan"]
    steps = "/".join(f"{s:g}" for s in plan["steps"])
    lines.append(
        f"candidate v{plan['candidate']} vs baseline v{plan['baseline']}: step "
        f"{status['step'] + 1} of {steps}%, every {plan['interval_s']:g}s, failures "
        f"{status['failures']}/{plan['failure_limit']}"
    )
    if status.get("reason"):
        lines.append(f"reason: {status['reason']}")
    last = status.get("last_verdict")
    if last:
        lines.append(f"last window: {last['outcome']} {'; '.join(last['reasons'])}".rstrip())
    lines.append("history:")
    for event in status.get("history", []):
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(event["at"]))
        lines.append(f"  {when}  {event['event']:<8} step {event['step'] + 1} "
                     f"({event['weight']:g}%)  {event['detail']}")  # fmt: skip
    return "\n".join(lines)


def publish_version(
    url: str, model: str, version: int, api_key: str = "", wait_s: float = 60.0
) -> None:
    """Have the server at ``url`` serve ``version`` of ``model``: load it (explicit model
    control), or wait for the repository poll to (poll mode). RolloutClientError when it
    does not serve it within ``wait_s``."""
    base = url.rstrip("/")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        with httpx.Client(timeout=120, headers=headers) as client:
            reply = client.post(f"{base}/v2/repository/models/{model}/load")
            if reply.status_code != 200 and "model control mode" not in reply.text:
                raise RolloutClientError(f"loading {model}: {reply.status_code}: {reply.text}")
            deadline = time.monotonic() + wait_s
            while True:
                index = client.post(f"{base}/v2/repository/index", json={"ready": True})
                ready = {(e["name"], e.get("version")) for e in index.json()}
                if (model, str(version)) in ready:
                    return
                if time.monotonic() > deadline:
                    raise RolloutClientError(
                        f"the server does not serve {model} version {version} after {wait_s:g} s "
                        "(with --model-control-mode none it loads new versions only at start)"
                    )
                time.sleep(0.5)
    except httpx.HTTPError as exc:
        raise RolloutClientError(f"{base}: {exc}; is the server running there?") from None
