"""The web process's connection pools across database restarts: the sync views' (psycopg_pool,
through Django) and the event loop's (below).

Two psycopg_pool defaults turn a restart into minutes of 500s: a connection is handed out
without a look (dead ones fail the request that gets them), and a failed reconnection is
retried with a doubling pause for five minutes (a database back after a minute waits for
the pool's next try, a minute later). settings.py passes check_connection and a short
reconnect_timeout; runtime_site.errors answers what still fails meanwhile with a 503.

A frozen server (SIGSTOP, a partition that drops packets) fails nothing by itself: the kernel
still accepts and acknowledges on its behalf, so no timeout of the server's or of TCP's fires,
and a request waited for an answer as long as the freeze lasted. Every round trip of the web
process's connections (both pools) therefore has a deadline of its own (DeadlineConnection),
and so has every round trip of a worker's (WorkerConnection, through runtime_site.postgresql).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import select
import time
import weakref
from collections.abc import AsyncIterator, Sequence
from datetime import UTC
from typing import Any, Self, TypeVar

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from psycopg import AsyncConnection, Connection, Cursor, OperationalError, errors
from psycopg.abc import PQGen
from psycopg_pool import AsyncConnectionPool, ConnectionPool

RV = TypeVar("RV")


# --- A deadline on every round trip ------------------------------------------------------
#
# RUNTIME_DB_QUERY_SECONDS bounds each wait of a connection for the server (a statement, a
# fetch, a commit or rollback, the pools' checks); `off`: no bound. Past it the statement
# is cancelled on the server (give_up: a live server stops it at once, its locks released;
# a frozen one, once it runs again, finds the session closed) and the connection closed, and
# the wait raises NoAnswer, an OperationalError: the request is a 503 (runtime_site.errors,
# the lean views), and the pool, handed back a closed connection, discards it and makes a
# fresh one. Nothing is left running or waiting on either side. No statement of the web
# process takes this long on a healthy server; one that does (a lock held that long) is a 503 too.
#
# A worker's connections (Django's own, one per thread: no pool) have a deadline of their
# own, RUNTIME_DB_WORKER_QUERY_SECONDS (60): a frozen server held a slice, and its
# heartbeat, for as long as it was frozen, and a server that never answers again (a
# failover; a partition that outlived the server's side of the connection) for ever, and
# with it the pool process. Past it the slice is abandoned as an infrastructure fault
# (tasks_app.engine._abandon) and tried again after a backoff, as after a restart; no
# slice fails for it. Longer than the web's, because no client waits on a worker and a
# worker runs statements a request never does: the retention trim's scans grow with the
# tables (one batch over 5 million checkpoints took 3-7 s on a busy two-core host), a big
# checkpoint's write with its state. The lease does not need the deadline to be short: it
# fences a worker the database stopped answering whatever the deadline (a slice that
# outlives its lease is refused its next write). A claim waiting for its tenant's turn
# (the tenant's row lock) waits only for other claims (one round trip) and creations under
# a queue cap (a web request's transaction). Only workers: a management
# command (a migration that builds an index) may wait as long as it needs (Ctrl-C stops it).
#
# The deadline is psycopg's own: Connection.wait, through which every round trip goes, takes
# a timeout (psycopg bounds its wait for a cancelled statement with it) and raises
# errors._WaitTimeout past it. Both are psycopg's internals, not its documented API: an
# upgrade that changes them fails tests/test_db_deadline.py. Why not one of the alternatives:
# - asyncio.timeout() around the lean reads: psycopg answers a cancelled wait by sending a
#   cancel request to the server, waiting up to 5 s for it and 5 s more for the statement to
#   end (psycopg 3.3 AsyncConnection.wait). Frozen, the server takes the cancel's connection
#   and never answers it: every abandoned read cost 10 s more and a connection attempt.
# - A watchdog thread that shuts the socket of a connection blocked too long down: it works
#   for both pools, but it needs a registry of who waits since when and a lock against the
#   race where the statement ends and the connection goes back to the pool (and to another
#   request) just as it is shut; the wait's own deadline has neither, and raises in the
#   thread or task that waits.
# - The pools' `timeout`: it bounds the wait for a connection, not for a borrowed one's
#   answer. TCP keepalives and tcp_user_timeout: the kernel still acknowledges.
# - statement_timeout: the server's own timer, which a frozen server does not run.


def query_seconds(variable: str = "RUNTIME_DB_QUERY_SECONDS", default: str = "10") -> float | None:
    """How long one round trip may wait for the server, from `variable`; None: as long as it takes."""
    seconds = os.getenv(variable, default)
    if seconds in ("off", "", "0"):
        return None
    try:
        value = float(seconds)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):  # read at boot: a clear refusal, not float()'s ValueError
        raise ImproperlyConfigured(f"{variable}={seconds!r}: use seconds above 0, or 'off'")
    return value


QUERY_SECONDS = query_seconds()
WORKER_QUERY_SECONDS = query_seconds("RUNTIME_DB_WORKER_QUERY_SECONDS", "60")


# How long the cancel of a statement past its deadline may take: a server that answers at
# all takes milliseconds (a cancel is a connection and one packet); a frozen one never
# answers, and a request waits this much longer for its 503, a worker's slice for its retry.
CANCEL_SECONDS = 1.0
WORKER_CANCEL_SECONDS = 2.0  # no client waits on a worker


class NoAnswer(OperationalError):
    """The database did not answer a round trip within the connection's deadline."""


class StalePlan(OperationalError):
    """A statement prepared on the connection is refused or missing (_Preparing): a fault of
    the moment, gone on a new connection."""


# The last connection this process could not make, and when (time.monotonic()); empty since
# one was made. A pool connects in threads (or tasks) of its own and answers a request that
# waited only PoolTimeout, "none free in time", the same whether every connection was busy or
# the server refused each new one (max_connections reached, a restart): the refusal is the
# cause, and the 503 names it (tasks_app.faults). A connection made clears it, so a pool
# that is merely busy after an outage is named busy.
_refused: list[tuple[float, OperationalError]] = []  # at most one; a list, so threads replace it without `global`
REFUSED_RECENTLY_SECONDS = 10.0  # past the pools' reconnect_timeout (5 s): the outage's own attempts


def _connected(refusal: OperationalError | None) -> None:
    _refused[:] = [] if refusal is None else [(time.monotonic(), refusal)]


def recent_refusal() -> OperationalError | None:
    """Why the last connection attempt of this process failed, if it failed lately and none succeeded since."""
    for when, refusal in _refused[:]:  # a copy: another thread may replace it meanwhile
        if time.monotonic() - when <= REFUSED_RECENTLY_SECONDS:
            return refusal
    return None


class DeadlineConnection(Connection[Any]):
    """The sync pool's connections (Django's): every round trip waits at most QUERY_SECONDS,
    and a session the server ended says why (ended_by)."""

    @classmethod
    def connect(cls, conninfo: str = "", **kwargs: Any) -> Self:
        try:
            conn = super().connect(conninfo, **kwargs)
        except OperationalError as exc:
            _connected(exc)
            raise
        _connected(None)
        return conn

    # The server's FATAL heard between round trips: its SQLSTATE and message, read at once
    # (a Diagnostic reads them from a result libpq frees after the handler).
    ended_by: tuple[str, str] | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.hear_fatal()

    def hear_fatal(self) -> None:
        """Keep the server's FATAL in ended_by (also for a connection made a DeadlineConnection
        after it connected: runtime_site.postgresql)."""
        heard = weakref.ref(self)  # not self: a handler holding it would keep a closed connection alive

        def notice(diag: errors.Diagnostic) -> None:
            if diag.severity_nonlocalized == "FATAL" and (conn := heard()) is not None:
                conn.ended_by = (diag.sqlstate or "", diag.message_primary or "")

        self.add_notice_handler(notice)

    @classmethod
    def deadline(cls) -> tuple[float | None, str]:
        """Seconds a round trip may wait (None: no bound), and the setting that says so."""
        return QUERY_SECONDS, "RUNTIME_DB_QUERY_SECONDS"

    # interval: psycopg's own default (how often a wait wakes to notice Ctrl-C).
    def wait(self, gen: PQGen[RV], interval: float = 0.1, timeout: float | None = None) -> RV:
        try:
            return self._wait(gen, interval, timeout)
        except NoAnswer:
            raise
        except OperationalError as exc:
            if exc.sqlstate or (ended := self.ended_by) is None:
                raise
            # The server ended the session while we were not waiting for it (this process was
            # stopped inside a transaction past idle_in_transaction_session_timeout, an operator
            # terminated it between statements): libpq took its FATAL for a notice, and the next
            # round trip only found the socket closed ("server closed the connection
            # unexpectedly"). Raised as what the server said, SQLSTATE and all, so the answer
            # names the cause (tasks_app.faults), not "unreachable".
            sqlstate, message = ended
            try:
                said: type[errors.Error] = errors.lookup(sqlstate)
            except KeyError:  # a SQLSTATE psycopg does not know: the lost connection it is
                raise exc from None
            raise said(message or str(exc)) from exc

    def _wait(self, gen: PQGen[RV], interval: float, timeout: float | None) -> RV:
        seconds, setting = self.deadline()
        if timeout is not None or seconds is None:  # a caller's own bound (psycopg's notifies) stands
            return super().wait(gen, interval, timeout)
        try:
            return super().wait(gen, interval, seconds)
        except errors._WaitTimeout:
            self.give_up()
            raise NoAnswer(f"the database did not answer within {seconds:g} s ({setting})") from None

    cancel_seconds = CANCEL_SECONDS

    def give_up(self) -> None:
        """Past the deadline, mid-statement: no later statement could use the connection.
        Cancelled on the server first, then closed.

        Closing stops the client only. A server that is alive but slow to answer (the
        statement waits for a lock a migration or an operator holds, or simply runs long)
        does not notice a closed socket while it waits or runs: the statement went on in its
        backend, holding its locks and a connection slot, and a write ran once the lock was
        free, landing unseen long after the request was answered 503 (a cancel the client
        was told failed, then done; a worker's ledger row for a call never sent, a step
        committed after the next slice began). A cancel reaches it at once; a frozen server
        hears neither, and costs cancel_seconds more. What it ran before the cancel is the
        outcome a dropped connection leaves unknown anyway."""
        with contextlib.suppress(errors.Error):  # CancellationTimeout: a frozen server
            self.cancel_safe(timeout=self.cancel_seconds)
        self.close()


class WorkerConnection(DeadlineConnection):
    """A worker's connections (runtime_site.postgresql): as DeadlineConnection, within
    WORKER_QUERY_SECONDS."""

    cancel_seconds = WORKER_CANCEL_SECONDS

    @classmethod
    def deadline(cls) -> tuple[float | None, str]:
        return WORKER_QUERY_SECONDS, "RUNTIME_DB_WORKER_QUERY_SECONDS"


class DeadlineAsyncConnection(AsyncConnection[Any]):
    """The event loop's pool's connections: as DeadlineConnection."""

    @classmethod
    async def connect(cls, conninfo: str = "", **kwargs: Any) -> Self:
        try:
            conn = await super().connect(conninfo, **kwargs)
        except OperationalError as exc:
            _connected(exc)
            raise
        _connected(None)
        return conn

    @classmethod
    def deadline(cls) -> tuple[float | None, str]:
        return QUERY_SECONDS, "RUNTIME_DB_QUERY_SECONDS"

    async def wait(self, gen: PQGen[RV], interval: float = 0.1, timeout: float | None = None) -> RV:
        seconds, setting = self.deadline()
        if timeout is not None or seconds is None:
            return await super().wait(gen, interval, timeout)
        try:
            return await super().wait(gen, interval, seconds)
        except errors._WaitTimeout:
            with contextlib.suppress(errors.Error):  # as DeadlineConnection.give_up
                await self.cancel_safe(timeout=CANCEL_SECONDS)
            await self.close()
            raise NoAnswer(f"the database did not answer within {seconds:g} s ({setting})") from None


# The class of the connections Django's backend makes itself (without a pool):
# runtime_site.postgresql's. None: psycopg's own, unbounded (management commands, tests);
# a worker sets WorkerConnection when it starts (runtime_site.celery).
own_connection_class: type[Connection[Any]] | None = None


# What one statement can carry bound apart from it: the protocol counts its values in 16 bits.
MAX_BOUND_VALUES = 65535


def bound_cursor(conn: Any, params: Sequence[Any]) -> Any:
    """A cursor of Django's connection `conn` for a statement with `params` that sends the
    values apart from the statement (server-side binding), so PostgreSQL prepares a statement
    once it has run prepare_threshold times on the connection (RUNTIME_DB_PREPARE_THRESHOLD)
    and then only executes it. For the statements run again and again with new values: a
    step's commit (tasks_app.leases.fenced_write) took 0.73 ms with the values written into
    its text, which PostgreSQL parsed and planned each time, and 0.43 ms prepared (issue 14).
    Wrapped as Django wraps its own, so its error classes, execute_wrappers and captured
    queries see these statements too. The ORM's cursors keep client-side binding: they
    never prepare. Elsewhere (SQLite), and for a statement of more values than binding
    carries (a step that logged thousands of lines): the connection's own cursor, which
    writes them into the statement, as before; a statement that size is never run again."""
    if conn.vendor != "postgresql" or len(params) > MAX_BOUND_VALUES:
        return conn.cursor()
    conn.ensure_connection()
    with conn.wrap_database_errors:
        cursor = _Preparing(conn.connection)
    return conn.make_debug_cursor(cursor) if conn.queries_logged else conn.make_cursor(cursor)


class _Preparing(Cursor[Any]):
    """Server-side binding, and the connection's prepare_threshold for this cursor's
    statements alone. psycopg counts towards it every statement of a connection that has one,
    keyed by its text: the ORM's too, which carry their values in their text and are never
    prepared, so a connection kept its last hundred alive (1 MB statements, 100 MB). Django's
    connections have none (its default); these statements set it while they run.

    A statement prepared before a migration changed what it returns is refused ("cached plan
    must not change result type"), and one the server forgot is missing (DISCARD ALL or
    DEALLOCATE ALL run by the ORM, which psycopg no longer watches), until the connection is
    closed or psycopg forgets its statements on a rollback: a fault of the moment, raised as
    one (StalePlan, an OperationalError), which the web answers with a 503 and a worker with
    a retry on a new connection."""

    def execute(self, query: Any, params: Any = None, **kwargs: Any) -> Any:
        conn = self.connection
        conn.prepare_threshold = settings.RUNTIME_DB_PREPARE_THRESHOLD
        try:
            return super().execute(query, params, **kwargs)
        except errors.FeatureNotSupported as exc:
            if exc.diag.source_function != "RevalidateCachedQuery":  # the message may be translated
                raise
            raise StalePlan(f"a statement prepared before a migration: {exc}") from exc
        except errors.InvalidSqlStatementName as exc:
            raise StalePlan(f"a prepared statement the server forgot: {exc}") from exc
        finally:
            conn.prepare_threshold = None


def prepare_threshold() -> int | None:
    """RUNTIME_DB_PREPARE_THRESHOLD: runs of one statement before it is prepared; None:
    never. Django leaves prepared statements off for poolers in transaction mode that
    predate their support (PgBouncer < 1.21); such a deployment sets it to `off`."""
    threshold = os.getenv("RUNTIME_DB_PREPARE_THRESHOLD", "5")
    if threshold in ("off", ""):
        return None
    if not threshold.isdigit():  # read by every process at boot: a clear refusal, not int()'s ValueError
        raise ImproperlyConfigured(
            f"RUNTIME_DB_PREPARE_THRESHOLD={threshold!r}: use a number of runs (0: at the first) or 'off'"
        )
    return int(threshold)


def idle_in_transaction_ms(lease_seconds: float) -> int | None:
    """RUNTIME_DB_IDLE_IN_TRANSACTION_SECONDS, in milliseconds: how long PostgreSQL lets a
    session of ours sit idle inside a transaction (its process stopped) before it ends it
    and releases its locks (settings.py says why); by default the lease, at least 5 s.
    None: 'off', the server's own setting."""
    seconds = os.getenv("RUNTIME_DB_IDLE_IN_TRANSACTION_SECONDS", "")
    if seconds == "off":
        return None
    try:
        value = float(seconds) if seconds else max(float(lease_seconds), 5.0)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):  # read by every process at boot: a clear refusal
        raise ImproperlyConfigured(f"RUNTIME_DB_IDLE_IN_TRANSACTION_SECONDS={seconds!r}: use seconds above 0, or 'off'")
    return max(1, round(value * 1000))


def check_connection(conn: Any) -> None:
    """psycopg_pool's check before handing a connection out, and on failure a drain: a
    connection the server ended is rarely alone (a restart or pg_terminate_backend ends
    them all), and the pool would otherwise try each dead one in turn, pausing longer
    (1 s, 2 s, 4 s ...) before each. Drained, the client waits for a fresh connection.

    The check's round trip is paid only when the socket has something to read: an idle
    connection hears from the server only when it is ended (the FATAL message, then the
    close, or the close alone from a killed server's kernel). A silent socket needs no
    query, which was one round trip in four of a snapshot read."""
    if not conn.closed and not readable(conn):
        return
    try:
        ConnectionPool.check_connection(conn)
    except Exception:
        from django.db import connections

        # connections[] is typed as the base wrapper; PostgreSQL's has the pool.
        connections["default"].pool.drain()  # type: ignore[attr-defined]
        raise


def readable(conn: Any) -> bool:
    """The socket of a psycopg connection has something to read (or is gone)."""
    poller = select.poll()  # not select.select: a web process holding streams has fds above its limit (1024)
    try:
        poller.register(conn.fileno(), select.POLLIN)
        return bool(poller.poll(0))
    except (OSError, ValueError):  # no socket any more
        return True


# --- The event loop's own pool -----------------------------------------------------------
#
# The lean read paths (runtime_site/lean.py: the task snapshot, the event stream's start and
# its catch-up reads) query PostgreSQL from the event loop with psycopg's async connections,
# without a thread hop and without the ORM. They borrow from a small pool of their own, one
# per event loop (uvicorn runs one): its size bounds what the streams of a web process hold,
# whatever their number. Across a database restart it behaves as the sync pool above: every
# connection is checked before it is handed out (a dead one drains the pool), a failed
# reconnection is retried for 5 s, and a borrower waits at most `timeout`; what fails
# meanwhile is a psycopg OperationalError, which the lean views answer with a 503.

ASYNC_POOL_MAX = int(os.getenv("RUNTIME_DB_ASYNC_POOL_MAX", "4"))
_async_pools: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, AsyncConnectionPool] = weakref.WeakKeyDictionary()


def async_available() -> bool:
    """Whether the lean paths read the database from the event loop (settings.RUNTIME_DB_ASYNC_POOL:
    the web process on PostgreSQL); if not, they leave their requests to the full path."""
    return bool(getattr(settings, "RUNTIME_DB_ASYNC_POOL", False))


async def _check_async(conn: AsyncConnection[Any]) -> None:
    """check_connection, for the event loop's pool: a query only when the socket says the
    server spoke (it ended the connection), and on failure a drain."""
    if not conn.closed and not readable(conn):
        return
    try:
        await AsyncConnectionPool.check_connection(conn)
    except Exception:
        pool = _async_pools.get(asyncio.get_running_loop())
        if pool is not None:
            await pool.drain()
        raise


async def _configure_async(conn: AsyncConnection[Any]) -> None:
    # Statements run one at a time and only read, or write one row (a key's last use).
    await conn.set_autocommit(True)


def _async_params() -> dict[str, Any]:
    """The connection parameters of DATABASES["default"] (those Django itself connects with),
    with psycopg's own loaders (jsonb as Python values) and timestamps in UTC, as the ORM reads them."""
    from django.db import connections
    from django.db.backends.postgresql.psycopg_any import register_tzloader
    from psycopg import adapt, adapters

    params = connections["default"].get_connection_params()
    for django_only in ("context", "cursor_factory"):
        params.pop(django_only, None)
    # Server-side prepared statements: the lean read joins five tables, and planning it took
    # longer than running it (0.4 ms of 0.5).
    params["prepare_threshold"] = settings.RUNTIME_DB_PREPARE_THRESHOLD
    context = adapt.AdaptersMap(adapters)
    register_tzloader(UTC, context)
    params["context"] = context
    return params


def async_pool() -> AsyncConnectionPool:
    """This event loop's pool, opened on first use."""
    loop = asyncio.get_running_loop()
    pool = _async_pools.get(loop)
    if pool is None:
        pool = AsyncConnectionPool(
            kwargs=_async_params(),
            connection_class=DeadlineAsyncConnection,
            min_size=1,
            max_size=ASYNC_POOL_MAX,
            open=False,
            timeout=float(os.getenv("RUNTIME_DB_POOL_TIMEOUT", "5")),
            reconnect_timeout=5.0,
            check=_check_async,
            configure=_configure_async,
            name="lean",
        )
        _async_pools[loop] = pool
    return pool


@contextlib.asynccontextmanager
async def borrow() -> AsyncIterator[AsyncConnection[Any]]:
    """`async with borrow() as conn:` a connection of this loop's pool, opened on first use."""
    pool = async_pool()
    if pool.closed:
        await pool.open(wait=False)
    async with pool.connection() as conn:
        yield conn


async def close_async_pool() -> None:
    """Close this loop's pool (tests that run a loop of their own; a web process never does)."""
    pool = _async_pools.pop(asyncio.get_running_loop(), None)
    if pool is not None:
        await pool.close()
