"""Canonical JSON and its hash: one encoding for everything that is hashed or compared
(checkpoint checksums, the audit chain, request fingerprints, ledger arguments)."""

from __future__ import annotations

import hashlib
import json
from typing import Any


def canonical_json(value: Any) -> str:
    """Sorted keys, no spaces, unicode kept: the same value always gives the same text."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def sha256_hex(text: str) -> str:
    """sha256 of `text` (UTF-8), in hex. For a value, hash canonical_json(value)."""
    return hashlib.sha256(text.encode()).hexdigest()
