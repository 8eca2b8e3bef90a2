"""The web process's deadline on a database round trip (runtime_site.dbpool.DeadlineConnection):
a wait past RUNTIME_DB_QUERY_SECONDS is an OperationalError, the connection is closed, and the
pool it came from serves a fresh one next. A statement that outlasts the deadline stands in
here for a server that does not answer; tests/test_database_restart.py freezes a real one."""

from __future__ import annotations

import asyncio
import time

import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool, ConnectionPool

from conftest import database_url, wait_until
from runtime_site import dbpool

pytestmark = pytest.mark.django_db

DEADLINE = 0.5


@pytest.fixture
def deadline(monkeypatch: pytest.MonkeyPatch) -> float:
    monkeypatch.setattr(dbpool, "QUERY_SECONDS", DEADLINE)
    return DEADLINE


def test_a_round_trip_past_the_deadline_fails_and_the_pool_serves_a_fresh_connection(deadline):
    with ConnectionPool(
        database_url(), min_size=1, max_size=1, connection_class=dbpool.DeadlineConnection, timeout=5
    ) as pool:
        with pool.connection() as conn:
            started = time.monotonic()
            with pytest.raises(psycopg.OperationalError, match=r"did not answer within 0\.5 s"):
                conn.execute("SELECT pg_sleep(5)")
            assert time.monotonic() - started < deadline + 1
            assert conn.closed
        with pool.connection() as conn:  # the only slot: the closed connection was not kept
            assert conn.execute("SELECT 1").fetchone() == (1,)


def test_the_event_loops_connections_keep_the_same_deadline(deadline):
    async def run() -> None:
        async with AsyncConnectionPool(
            database_url(), min_size=1, max_size=1, connection_class=dbpool.DeadlineAsyncConnection, timeout=5
        ) as pool:
            async with pool.connection() as conn:
                started = time.monotonic()
                with pytest.raises(psycopg.OperationalError, match="did not answer"):
                    await conn.execute("SELECT pg_sleep(5)")
                assert time.monotonic() - started < deadline + 1
                assert conn.closed
            async with pool.connection() as conn:
                assert await (await conn.execute("SELECT 1")).fetchone() == (1,)

    asyncio.run(run())


def statement_running(name: str, statement: str) -> bool:
    """Whether a session named `name` is running a statement that starts with `statement`."""
    with psycopg.connect(database_url(), autocommit=True) as look:
        query = "SELECT 1 FROM pg_stat_activity WHERE application_name = %s AND state = 'active' AND query LIKE %s"
        return look.execute(query, [name, statement.replace("%", "%%") + "%"]).fetchone() is not None


def test_a_statement_the_web_gave_up_at_its_deadline_no_longer_runs_on_the_server(deadline):
    """Closing the connection at the deadline stopped the client, not the server: a long
    statement went on in its backend for as long as it took, holding its locks and a
    connection slot, well after the request was answered 503. It is cancelled first."""
    name = "web-gave-up"
    with ConnectionPool(
        f"{database_url()}?application_name={name}",
        min_size=1,
        max_size=1,
        connection_class=dbpool.DeadlineConnection,
        timeout=5,
    ) as pool:
        with pool.connection() as conn, pytest.raises(psycopg.OperationalError, match="did not answer"):
            conn.execute("SELECT pg_sleep(60)")
        # Without the cancel it runs on for a minute; the wait is far shorter than that.
        wait_until(
            lambda: not statement_running(name, "SELECT pg_sleep(60)"),
            timeout=10,
            what="the given-up statement to stop on the server",
        )


def test_a_write_the_web_gave_up_waiting_for_a_lock_does_not_land_later(deadline):
    """A cancel answered 503 (its statement waited past the deadline for a row another
    transaction held) must not land once that lock is free: the client was told it failed."""
    url, name = database_url(), "web-gave-up-a-write"
    with psycopg.connect(url, autocommit=True) as setup:
        setup.execute("CREATE TABLE IF NOT EXISTS deadline_probe_web (x int)")
        setup.execute("TRUNCATE deadline_probe_web")
    try:
        with ConnectionPool(
            f"{url}?application_name={name}", min_size=1, max_size=1, connection_class=dbpool.DeadlineConnection
        ) as pool:
            with psycopg.connect(url) as holder:
                holder.execute("LOCK TABLE deadline_probe_web IN ACCESS EXCLUSIVE MODE")  # held until its commit
                with pool.connection() as conn, pytest.raises(psycopg.OperationalError, match="did not answer"):
                    conn.execute("INSERT INTO deadline_probe_web VALUES (1)")
                # Cancelled while the lock is still held: not merely waiting for it.
                assert not statement_running(name, "INSERT INTO deadline_probe_web")
                holder.commit()  # the lock is free: a statement still waiting for it would run now
            with psycopg.connect(url, autocommit=True) as look:
                assert look.execute("SELECT count(*) FROM deadline_probe_web").fetchone() == (0,)
    finally:
        with psycopg.connect(url, autocommit=True) as setup:
            setup.execute("DROP TABLE IF EXISTS deadline_probe_web")


def test_the_event_loops_connections_cancel_what_they_gave_up_too(deadline):
    name = "lean-gave-up"

    async def run() -> None:
        async with (
            AsyncConnectionPool(
                f"{database_url()}?application_name={name}",
                min_size=1,
                max_size=1,
                connection_class=dbpool.DeadlineAsyncConnection,
                timeout=5,
            ) as pool,
            pool.connection() as conn,
        ):
            with pytest.raises(psycopg.OperationalError, match="did not answer"):
                await conn.execute("SELECT pg_sleep(60)")

    asyncio.run(run())
    wait_until(
        lambda: not statement_running(name, "SELECT pg_sleep(60)"),
        timeout=10,
        what="the given-up statement to stop on the server",
    )


@pytest.mark.parametrize(("value", "seconds"), [(None, 10.0), ("2.5", 2.5), ("off", None), ("0", None)])
def test_the_deadline_comes_from_the_environment(monkeypatch, value, seconds):
    if value is None:
        monkeypatch.delenv("RUNTIME_DB_QUERY_SECONDS", raising=False)
    else:
        monkeypatch.setenv("RUNTIME_DB_QUERY_SECONDS", value)
    assert dbpool.query_seconds() == seconds


@pytest.fixture
def worker_deadline(monkeypatch: pytest.MonkeyPatch) -> float:
    """This process's own connections made as a worker's are (runtime_site.celery), with a short deadline."""
    monkeypatch.setattr(dbpool, "own_connection_class", dbpool.WorkerConnection)
    monkeypatch.setattr(dbpool, "WORKER_QUERY_SECONDS", DEADLINE)
    return DEADLINE


def test_a_workers_own_connections_fail_a_round_trip_past_the_worker_deadline_as_an_infrastructure_fault(
    worker_deadline,
):
    """Workers connect without a pool (Django's own connections): runtime_site.postgresql makes
    those of the class the worker chose, so a frozen server no longer holds a slice for as
    long as it is frozen; what it raises delays the task, never fails it."""
    from django.db import OperationalError, connections

    from tasks_app import faults

    conn = connections.create_connection("default")  # a fresh one, made as a worker makes its own
    try:
        conn.ensure_connection()
        assert type(conn.connection) is dbpool.WorkerConnection
        started = time.monotonic()
        with (
            pytest.raises(
                OperationalError, match=r"did not answer within 0\.5 s \(RUNTIME_DB_WORKER_QUERY_SECONDS\)"
            ) as raised,
            conn.cursor() as cursor,
        ):
            cursor.execute("SELECT pg_sleep(5)")
        assert time.monotonic() - started < worker_deadline + 1
        assert conn.connection.closed
        assert faults.is_infrastructure_error(raised.value)  # the slice is abandoned and retried, never failed
        conn.close()  # what the worker does after a fault (faults.drop_connection): the next query connects afresh
        with conn.cursor() as cursor:
            cursor.execute("SELECT 1")
            assert cursor.fetchone() == (1,)
    finally:
        conn.close()


def test_a_statement_a_worker_gave_up_at_its_deadline_does_not_run_later_on_the_server(worker_deadline):
    """Closing the connection at the deadline stopped the client, not the server: a statement
    waiting for a lock (a migration's, an operator's) went on waiting in its backend and ran
    as soon as the lock was free, long after the worker had abandoned the slice and counted it
    failed. A write the worker gave up must not land later, unseen (a ledger row written for a
    call never sent, a step committed after the next slice began): the statement is cancelled
    before the connection is closed."""
    from django.db import OperationalError, connections

    url = database_url()
    with psycopg.connect(url, autocommit=True) as setup:
        setup.execute("CREATE TABLE IF NOT EXISTS deadline_probe (x int)")
        setup.execute("TRUNCATE deadline_probe")
    conn = connections.create_connection("default")
    try:
        with psycopg.connect(url) as holder:
            holder.execute("LOCK TABLE deadline_probe IN ACCESS EXCLUSIVE MODE")  # held until its commit
            with pytest.raises(OperationalError, match="did not answer"), conn.cursor() as cursor:
                cursor.execute("INSERT INTO deadline_probe VALUES (1)")
            holder.commit()  # the lock is free: a statement still waiting for it runs now

        def given_up_statement_ended() -> bool:
            with psycopg.connect(url, autocommit=True) as look:
                return not look.execute(
                    "SELECT 1 FROM pg_stat_activity WHERE query LIKE 'INSERT INTO deadline_probe%%'"
                ).fetchone()

        wait_until(given_up_statement_ended, timeout=10, what="the given-up statement's backend to end")
        with psycopg.connect(url, autocommit=True) as look:
            assert look.execute("SELECT count(*) FROM deadline_probe").fetchone() == (0,)
    finally:
        conn.close()
        with psycopg.connect(url, autocommit=True) as setup:
            setup.execute("DROP TABLE IF EXISTS deadline_probe")


def test_a_management_commands_connections_keep_no_deadline(monkeypatch):
    """Outside a worker (manage.py, a migration that builds an index for minutes; the tests)
    Django's connections are psycopg's own."""
    from django.db import connections

    monkeypatch.setattr(dbpool, "own_connection_class", None)
    conn = connections.create_connection("default")
    try:
        conn.ensure_connection()
        assert type(conn.connection) is psycopg.Connection
    finally:
        conn.close()
