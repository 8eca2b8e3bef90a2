"""Infrastructure faults: what is never the agent's failure (issue 12).

A task survives anything short of losing the database. When the database, the broker or
the blob store cannot be reached, or drops a connection mid-statement (a restart, a
failover, `pg_terminate_backend`), the work in hand is abandoned without writing and tried
again after a backoff; the task is never failed for it. Only the agent's own errors (its
exceptions, its tools' answers) fail a task.

`is_infrastructure_error` is the one place that draws this line; the engine and the
Celery wrapper ask it, and so should any other edge that must tell the two apart.
"""

from __future__ import annotations

import contextlib

import botocore.exceptions
import kombu.exceptions
import psycopg
import redis.exceptions
from django.db import DatabaseError, InterfaceError, OperationalError, connection

# Connectivity, not content: the same request may well succeed a moment later.
# OperationalError also covers serialization failures, deadlocks, statement timeouts and
# SQLite's "database is locked": all transient, all safe to retry from the last commit.
_INFRASTRUCTURE: tuple[type[BaseException], ...] = (
    OperationalError,
    InterfaceError,  # Django's wrappers of the driver's errors
    psycopg.OperationalError,
    psycopg.InterfaceError,  # the driver's own (psycopg_pool's PoolTimeout too)
    # The server ended a session left idle in a transaction (settings: the process was
    # stopped mid-transaction, past a lease): an InternalError by its class, a lost connection by what it did.
    psycopg.errors.IdleInTransactionSessionTimeout,
    kombu.exceptions.OperationalError,  # the broker, as Celery/kombu report it
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
    botocore.exceptions.ConnectionError,
    botocore.exceptions.HTTPClientError,  # the S3 blob store
)

BACKOFF_FIRST_SECONDS = 1.0
BACKOFF_MAX_SECONDS = 30.0


def is_infrastructure_error(exc: BaseException) -> bool:
    """True when `exc` (or an error it was explicitly raised from) says a part of our
    infrastructure could not be reached or dropped us: retry later, never fail the task."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, _INFRASTRUCTURE):
            return True
        if isinstance(current, botocore.exceptions.ClientError):  # the store answered 5xx: it is unwell
            status = current.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
            if status >= 500:
                return True
        current = current.__cause__
    return False


def backoff(faults_in_a_row: int) -> float:
    """Seconds to wait before trying again after this many faults in a row: 1, 2, 4 ... 30."""
    return min(BACKOFF_MAX_SECONDS, BACKOFF_FIRST_SECONDS * 2 ** min(max(faults_in_a_row - 1, 0), 10))


def drop_connection() -> None:
    """After an infrastructure error this thread's database connection may be dead, and
    Django would hand it out again: close it, so the next query connects afresh."""
    with contextlib.suppress(DatabaseError):  # closing a connection the server already dropped
        connection.close()
