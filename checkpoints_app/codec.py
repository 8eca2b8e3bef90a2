"""Pure functions: canonical encoding, checksums and schema migrations of checkpoint state."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django.conf import settings

from common.canonical import canonical_json, sha256_hex

CURRENT_SCHEMA_VERSION: int = settings.RUNTIME["checkpoint"]["schema_version"]

# version N → function upgrading a version-N state to version N+1. It is given the agent's
# name too, since each agent's state has its own shape. Register with @migration(N).
MIGRATIONS: dict[int, Callable[[dict[str, Any], str], dict[str, Any]]] = {}


def migration(
    from_version: int,
) -> Callable[[Callable[[dict[str, Any], str], dict[str, Any]]], Callable[[dict[str, Any], str], dict[str, Any]]]:
    def register(
        fn: Callable[[dict[str, Any], str], dict[str, Any]],
    ) -> Callable[[dict[str, Any], str], dict[str, Any]]:
        if from_version in MIGRATIONS:
            raise ValueError(f"a migration from checkpoint schema_version {from_version} already exists")
        MIGRATIONS[from_version] = fn
        return fn

    return register


class CheckpointCorrupt(Exception):
    """The stored checkpoint cannot be trusted; the task must not re-run from it blindly."""


def checksum(fields: dict[str, Any]) -> str:
    return sha256_hex(canonical_json(fields))


def verify_and_upgrade(fields: dict[str, Any], stored_checksum: str, *, agent: str) -> dict[str, Any]:
    """Return the checkpoint's state at the current schema version, or raise CheckpointCorrupt."""
    current = CURRENT_SCHEMA_VERSION  # read at call time: a test may move it on
    if checksum(fields) != stored_checksum:
        raise CheckpointCorrupt("checkpoint checksum mismatch")
    version = fields["schema_version"]
    if not isinstance(version, int) or version > current or version < 1:
        raise CheckpointCorrupt(f"unknown checkpoint schema_version {version!r} (this code reads up to {current})")
    state = fields["state"]
    while version < current:
        if version not in MIGRATIONS:
            raise CheckpointCorrupt(f"no migration from checkpoint schema_version {version}")
        state = MIGRATIONS[version](state, agent)
        version += 1
    return state
