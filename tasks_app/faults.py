"""Infrastructure faults: what is never the agent's failure (issue 12).

A task survives anything short of losing the database. When the database, the broker or
the blob store cannot be reached, or drops a connection mid-statement (a restart, a
failover, `pg_terminate_backend`), the work in hand is abandoned without writing and tried
again after a backoff; the task is never failed for it. Only the agent's own errors (its
exceptions, its tools' answers) fail a task.

`infrastructure_fault` is the one place that draws this line, and names the part that
failed: the engine and the Celery wrapper ask it (through `is_infrastructure_error`) before
they retry, and the web edges before they answer "unavailable, retry" (runtime_site.errors).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import botocore.exceptions
import kombu.exceptions
import psycopg
import psycopg_pool
import redis.exceptions
from django.db import DatabaseError, InterfaceError, OperationalError, connection

from runtime_site import blobstore, dbpool
from tasks_app import oauth

# The database's faults, by SQLSTATE (PostgreSQL's appendix A): the server could not run the
# statement now, or ended the session, for reasons of the moment, not of the statement. A
# statement retried from the last commit may well succeed. Every other SQLSTATE is about the
# statement or the data (a constraint, a syntax error, a statement too complex: 54000), and
# retrying it gives the same answer, so it is the caller's error or a bug, never "retry".
_SQLSTATE_CLASSES = {
    "08": "the database is unreachable",  # connection exception
    "53": "the database is out of resources (connections, memory or disk)",  # insufficient resources
    "57": "the database stopped the statement (operator intervention)",  # admin shutdown, crash, ...
}
_SQLSTATES = {
    "57014": "the database statement timed out",  # query_canceled: statement_timeout, or our own cancel at a deadline
    "57P01": "the database ended the session (an operator, or a shutdown)",  # admin_shutdown, pg_terminate_backend
    "57P02": "the database is restarting",  # crash_shutdown
    "57P03": "the database is starting up or shutting down",  # cannot_connect_now
    "57P05": "the database ended an idle session (idle_session_timeout)",
    # The server ended a session left idle in a transaction (settings: a process stopped
    # mid-transaction past a lease): an InternalError by its class, a lost connection by what it did.
    "25P03": "the database ended a session left idle in a transaction (idle_in_transaction_session_timeout)",
    "25P04": "the database transaction timed out (transaction_timeout)",
    # A server taking no writes for now (default_transaction_read_only: a failover's standby
    # not yet promoted, an operator's maintenance): by its class the transaction's state, by
    # what it says the server's, and the same write succeeds once it is writable again.
    "25006": "the database is read-only for now",
    "40001": "the database transaction conflicted with another (serialization failure)",
    "40P01": "the database transaction deadlocked with another",
    "55P03": "a database lock was not available in time (lock_timeout)",
    "58000": "the database server had a system error",
    "58030": "the database server had an I/O error",
}
UNREACHABLE = "the database is unreachable"
NO_SLOT = "the database has no connection slot free (max_connections, or a role's or database's CONNECTION LIMIT)"
# A connection the server refuses carries no SQLSTATE (libpq keeps none from a failed start),
# only the server's words: 53300's, as PostgreSQL words them ("sorry, too many clients
# already", "remaining connection slots are reserved ...", "too many connections for role
# ..."/"for database ..."). A server whose lc_messages is not English words them otherwise,
# and is named unreachable, as before.
_NO_SLOT_WORDS = ("too many clients", "connection slots are reserved", "too many connections for")
ISSUER_UNREACHABLE = "the token issuer is unreachable"

# Connectivity, not content, in the other parts: the same request may well succeed a moment later.
_OTHER_PARTS: tuple[tuple[type[BaseException] | tuple[type[BaseException], ...], str], ...] = (
    (kombu.exceptions.OperationalError, "the broker is unreachable"),  # as Celery/kombu report it
    ((redis.exceptions.ConnectionError, redis.exceptions.TimeoutError), "Redis is unreachable"),
    ((botocore.exceptions.ConnectionError, botocore.exceptions.HTTPClientError), "the blob store is unreachable"),
)


def _sqlstate_fault(sqlstate: str) -> str | None:
    return _SQLSTATES.get(sqlstate) or _SQLSTATE_CLASSES.get(sqlstate[:2])


def _driver_fault(exc: psycopg.Error) -> str | None:
    """A psycopg error: by its SQLSTATE when the server sent one; without one, a connection
    that failed or was lost on our side (refused, closed, a pool with none free in time, a
    deadline that passed: runtime_site.dbpool) is a fault, any other client-side error is not."""
    if exc.sqlstate:
        return _sqlstate_fault(exc.sqlstate)
    if isinstance(exc, dbpool.NoAnswer):
        return "the database did not answer in time"
    if isinstance(exc, dbpool.StalePlan):
        return "a prepared database statement went stale (a migration)"
    if isinstance(exc, psycopg_pool.PoolTimeout):
        # None free in time: every connection busy, or none could be made (dbpool.recent_refusal).
        refusal = dbpool.recent_refusal()
        return (refusal is not None and _driver_fault(refusal)) or "no database connection was free in time"
    if isinstance(exc, psycopg.OperationalError) and any(words in str(exc) for words in _NO_SLOT_WORDS):
        return NO_SLOT
    if isinstance(exc, psycopg.OperationalError | psycopg.InterfaceError):
        return UNREACHABLE
    return None


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """`exc`, then each error it was explicitly raised from (Django wraps the driver's so)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__


def infrastructure_fault(exc: BaseException) -> str | None:
    """What part of our infrastructure `exc` says could not be reached or dropped us, in words
    for the caller ("the database is unreachable", "the database statement timed out"), or
    None when it is no infrastructure fault (the agent's, the caller's or a bug).

    The one classification: the engine and the Celery wrapper retry on it (never fail a task
    for it), the web edges answer it with a 503 and Retry-After (runtime_site.errors), the
    MCP edge with -32003, a stream with its "unavailable" end."""
    wrapped: str | None = None
    for current in _chain(exc):
        if isinstance(current, psycopg.Error):  # the driver's own word, SQLSTATE and all, decides
            return _driver_fault(current)
        if isinstance(current, OperationalError | InterfaceError):
            # Django's wrapper: its cause, when the driver's, decides; without one it is
            # Django's own ("connection already closed") or SQLite's ("database is locked").
            wrapped = wrapped or UNREACHABLE
            continue
        for kinds, cause in _OTHER_PARTS:
            if isinstance(current, kinds):
                return cause
        if isinstance(current, blobstore.BlobStoreUnavailable):  # the local store's disk refused (its words)
            return current.strerror
        if isinstance(current, oauth.IssuerUnavailable):  # its JWKS cannot be fetched, and the key is not cached
            return ISSUER_UNREACHABLE
        if isinstance(current, botocore.exceptions.ClientError):  # the store answered 5xx: it is unwell
            status = current.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
            if status >= 500:
                return "the blob store is unavailable"
    return wrapped


def is_infrastructure_error(exc: BaseException) -> bool:
    """True when `exc` (or an error it was explicitly raised from) says a part of our
    infrastructure could not be reached or dropped us: retry later, never fail the task."""
    return infrastructure_fault(exc) is not None


BACKOFF_FIRST_SECONDS = 1.0
BACKOFF_MAX_SECONDS = 30.0


def backoff(faults_in_a_row: int) -> float:
    """Seconds to wait before trying again after this many faults in a row: 1, 2, 4 ... 30."""
    return min(BACKOFF_MAX_SECONDS, BACKOFF_FIRST_SECONDS * 2 ** min(max(faults_in_a_row - 1, 0), 10))


def drop_connection() -> None:
    """After an infrastructure error this thread's database connection may be dead, and
    Django would hand it out again: close it, so the next query connects afresh."""
    with contextlib.suppress(DatabaseError):  # closing a connection the server already dropped
        connection.close()
