"""Pure functions: canonical encoding, checksums and schema migrations of checkpoint state."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from typing import Any

from django.conf import settings

CURRENT_SCHEMA_VERSION: int = settings.RUNTIME["checkpoint"]["schema_version"]

# version N → function upgrading a version-N state dict to version N+1.
MIGRATIONS: dict[int, Callable[[dict[str, Any]], dict[str, Any]]] = {}


class CheckpointCorrupt(Exception):
    """The stored checkpoint cannot be trusted; the task must not re-run from it blindly."""


def canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def checksum(fields: dict[str, Any]) -> str:
    return hashlib.sha256(canonical_json(fields).encode()).hexdigest()


def verify_and_upgrade(fields: dict[str, Any], stored_checksum: str) -> dict[str, Any]:
    """Return the checkpoint's state at CURRENT_SCHEMA_VERSION, or raise CheckpointCorrupt."""
    if checksum(fields) != stored_checksum:
        raise CheckpointCorrupt("checkpoint checksum mismatch")
    version = fields["schema_version"]
    if not isinstance(version, int) or version > CURRENT_SCHEMA_VERSION or version < 1:
        raise CheckpointCorrupt(f"unknown checkpoint schema_version {version!r}")
    state = fields["state"]
    while version < CURRENT_SCHEMA_VERSION:
        if version not in MIGRATIONS:
            raise CheckpointCorrupt(f"no migration from checkpoint schema_version {version}")
        state = MIGRATIONS[version](state)
        version += 1
    return state
