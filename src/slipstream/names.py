"""What a model name may be: one directory name of the repository, nothing that walks out.

A model name arrives from clients (URL paths, gRPC fields, the OpenAI ``model`` field),
from the command line (``--load-model``) and from config files (``name:``), and the
server joins it onto the repository path. So every entry point checks it here, before
anything touches the disk. The rule follows Triton's:

* 1 to :data:`MAX_MODEL_NAME_LENGTH` characters, ASCII only (no look-alikes such as a
  fullwidth solidus or a Cyrillic letter);
* letters, digits, ``_``, ``-`` and ``.``; the first one a letter, digit or ``_``.

That excludes ``.`` and ``..``, hidden directories, path separators (``/`` and ``\\``),
absolute paths, NUL and every other control character.

Example::

    >>> validate_model_name("resnet50.v2")
    'resnet50.v2'
    >>> model_name_problem("../evil")
    "contains '/', a path separator"
"""

from __future__ import annotations

import re
from urllib.parse import unquote

from slipstream.errors import InvalidRequest

MAX_MODEL_NAME_LENGTH = 128
MODEL_NAME_RULE = (
    f"a model name is 1 to {MAX_MODEL_NAME_LENGTH} ASCII letters, digits, '_', '-' or '.', "
    "starting with a letter, digit or '_' (one directory of the model repository)"
)

_VALID = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
# How much of a refused name an error message repeats.
_SHOWN_CHARS = 64


def model_name_problem(name: str) -> str | None:
    """Why ``name`` is not a valid model name, or None when it is."""
    # One regex match decides (its classes are ASCII); the rest only explains a refusal.
    # This runs on every request: ~0.2 us instead of a Python loop over the characters.
    if len(name) <= MAX_MODEL_NAME_LENGTH and _VALID.fullmatch(name) is not None:
        return None
    if not name:
        return "is empty"
    if len(name) > MAX_MODEL_NAME_LENGTH:
        return f"is {len(name)} characters long, more than {MAX_MODEL_NAME_LENGTH}"
    for char in name:
        if not char.isascii():
            return f"contains {char!r} (U+{ord(char):04X}), which is not ASCII"
        if ord(char) < 0x20 or ord(char) == 0x7F:
            return f"contains the control character U+{ord(char):04X}"
        if char in "/\\":
            return f"contains {char!r}, a path separator"
    if name in (".", ".."):
        return "is a relative directory reference"
    if _VALID.fullmatch(name) is None:
        bad = next((c for c in name if not (c.isalnum() or c in "_.-")), name[0])
        return f"starts with {bad!r}" if bad == name[0] else f"contains {bad!r}"
    return None


def validate_model_name(name: str, field: str = "model name") -> str:
    """``name`` unchanged when valid; else InvalidRequest (400) naming the rule.

    ``field`` says where the name came from in the message, e.g. ``"model"`` for the
    OpenAI request field.
    """
    problem = model_name_problem(name)
    if problem is None:
        return name
    shown = name if len(name) <= _SHOWN_CHARS else name[:_SHOWN_CHARS] + "..."
    raise InvalidRequest(f"{field} {shown!r} {problem}; {MODEL_NAME_RULE}")


def checked_model_name(name: str) -> str:
    """``name`` unchanged when valid; else ValueError naming the rule (for a config's or
    an option's validator, which report it under their field)."""
    problem = model_name_problem(name)
    if problem is not None:
        raise ValueError(f"{name[:64]!r} {problem}; {MODEL_NAME_RULE}")
    return name


def path_model_name(segment: str) -> str:
    """The model name in a URL path segment: percent-decoded once, then validated.

    Decoding first means ``%2F`` is refused as the separator it stands for; a name
    still holding ``%`` after one decoding (``%252F``) is refused for the ``%``.
    """
    return validate_model_name(unquote(segment, errors="replace"))


# A job id (jobs/, the Idempotency-Key header): printable, short, safe in a URL path and a
# Redis key.
JOB_ID_PATTERN = "^[A-Za-z0-9_][A-Za-z0-9._:-]{0,127}$"
_JOB_ID = re.compile(JOB_ID_PATTERN)


def check_job_id(job_id: str, where: str = "Idempotency-Key") -> str:
    """``job_id`` when it is a valid job id; InvalidRequest naming ``where`` otherwise.

    >>> check_job_id("order-17:a")
    'order-17:a'
    """
    if not _JOB_ID.fullmatch(job_id):
        raise InvalidRequest(
            f"{where}: {job_id[:_SHOWN_CHARS]!r} is not a job id; expected 1 to 128 ASCII "
            "letters, digits, '_', '.', ':' or '-', starting with a letter, digit or '_'"
        )
    return job_id
