"""`slipstream keys create | list | revoke` as a user runs them."""

from __future__ import annotations

import subprocess
from pathlib import Path

from slipstream.security.keys import KeyRing
from tests.utils import slipstream_command


def keys(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*slipstream_command(), "keys", *args], capture_output=True, text=True)


def test_create_prints_the_key_once_list_shows_no_secret_and_revoke_removes_it(
    tmp_path: Path,
) -> None:
    auth = str(tmp_path / "keys.json")
    made = keys("create", "--auth-file", auth, "--name", "ci", "--role", "infer",
                "--models", "mlp,minilm", "--rate", "5", "--burst", "10")  # fmt: skip
    assert made.returncode == 0, made.stderr
    secret = made.stdout.strip()
    assert secret.startswith("ss-") and "shown only now" in made.stderr
    key = KeyRing.load(Path(auth)).find(secret.encode())
    assert key is not None and key.models == {"mlp", "minilm"} and key.limits.burst == 10
    listed = keys("list", "--auth-file", auth)
    assert "ci\tinfer\tmodels=minilm,mlp\trate=5\tburst=10" in listed.stdout
    assert secret not in listed.stdout and key.sha256 not in listed.stdout
    again = keys("create", "--auth-file", auth, "--name", "ci")
    assert again.returncode == 1 and "a key named 'ci' exists" in again.stderr
    negative = keys("create", "--auth-file", auth, "--name", "x", "--rate", "-1")
    assert negative.returncode == 2 and "must not be negative" in negative.stderr
    assert keys("revoke", "--auth-file", auth, "--name", "ci").returncode == 0
    assert KeyRing.load(Path(auth)).keys == []
    gone = keys("revoke", "--auth-file", auth, "--name", "ci")
    assert gone.returncode == 1 and "no key named 'ci'" in gone.stderr


def test_create_refuses_values_that_would_break_the_file_or_widen_the_key(
    tmp_path: Path,
) -> None:
    """Audit defect 5: --rate nan|inf was written as null (a file no server or later
    command could read, so revokes were silently not applied), --name "" likewise, and
    --models "" made a key for every model."""
    auth = str(tmp_path / "keys.json")
    assert keys("create", "--auth-file", auth, "--name", "ok").returncode == 0
    for args, named in (
        (("--rate", "nan"), "--rate"), (("--rate", "inf"), "--rate"),
        (("--rate", "-inf"), "--rate"), (("--models", ""), "--models"),
        (("--models", ","), "--models"), (("--models", " , "), "--models"),
    ):  # fmt: skip
        made = keys("create", "--auth-file", auth, "--name", "bad", *args)
        assert made.returncode != 0 and named in made.stderr, (args, made.stderr)
    for name in ("", " "):
        made = keys("create", "--auth-file", auth, "--name", name)
        assert made.returncode != 0 and "--name" in made.stderr, (name, made.stderr)
    # The file still loads, and holds only the good key.
    assert [key.name for key in KeyRing.load(Path(auth)).keys] == ["ok"]
    assert keys("list", "--auth-file", auth).returncode == 0
    assert keys("revoke", "--auth-file", auth, "--name", "ok").returncode == 0
