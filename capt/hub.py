"""Hub repo ids, checked once for every caller (capsule push/pull, a hub dataset for training, the app).

An id is "owner/name" as the Hub spells it: letters, digits, '-', '_' and '.', no "..", at most 96
characters per part. A dataset may also be given by a bare legacy name ("super_glue").
"""
from __future__ import annotations

import re

from .errors import CaptError

_PART = r"[A-Za-z0-9](?:[\w.-]{0,94}[A-Za-z0-9_])?"
REPO_ID = re.compile(rf"^{_PART}/{_PART}$")
BARE_NAME = re.compile(rf"^{_PART}$")
EXAMPLE = {"model": "your-name/capt-cb", "dataset": "aps/super_glue"}


def is_repo_id(value: str, kind: str = "model") -> bool:
    value = (value or "").strip()
    ok = REPO_ID.match(value) or (kind == "dataset" and BARE_NAME.match(value))
    return bool(ok) and ".." not in value and "--" not in value


def check_repo_id(value: str, kind: str = "model") -> str:
    """The id stripped of surrounding spaces, or a CaptError that says what a valid one looks like."""
    if kind not in EXAMPLE:
        raise CaptError(f"unknown repo kind {kind!r}; valid: {', '.join(EXAMPLE)}")
    if not is_repo_id(value, kind):
        raise CaptError(f"{value!r} is not a Hub {kind} id; give one like '{EXAMPLE[kind]}' (owner/name: letters, "
                        "digits, '-', '_' and '.')")
    return value.strip()
