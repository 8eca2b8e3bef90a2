"""A web request whose database session fails under it mid-transaction: ended by an operator
(pg_terminate_backend), cancelled by the server's statement_timeout, refused a lock past
lock_timeout, or ended as idle in a transaction while the web process was stopped. Each is a
fault of the moment (tasks_app.faults.infrastructure_fault): the answer is a 503 with
Retry-After that names its cause, never a 500, and the next request succeeds.

Real parts only: uvicorn, PostgreSQL, and a lock this test holds on the task's row, so the
request (a cancel, which locks the row first) is inside its transaction, waiting, when its
session fails."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import quote

import httpx
import psycopg
import pytest

from conftest import Processes, SseClient, database_url, free_port, wait_until
from tasks_app.tests.test_engine import new_task

pytestmark = pytest.mark.django_db(transaction=True)

WEB = "web-in-a-transaction"  # the application_name of the web process's sessions
# The web's session waiting for the row lock this test holds.
WAITING_FOR_THE_LOCK = """
SELECT pid FROM pg_stat_activity
 WHERE datname = current_database() AND application_name = %s AND wait_event_type = 'Lock'
"""
IDLE_IN_A_TRANSACTION = """
SELECT pid FROM pg_stat_activity
 WHERE datname = current_database() AND application_name = %s AND state = 'idle in transaction'
"""


def start_web(processes: Processes, options: str = "", **env: str) -> httpx.Client:
    """uvicorn whose sessions are named WEB and start with the server `options` given."""
    url = f"{database_url()}?application_name={WEB}" + (f"&options={quote(options)}" if options else "")
    port = free_port()
    # A deadline far above the waits here: the session's own fault must be what ends the request.
    processes.web(port, DATABASE_URL=url, RUNTIME_DB_QUERY_SECONDS="60", **env)
    return httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=httpx.Timeout(60))


@contextmanager
def row_locked(task_id: Any) -> Iterator[psycopg.Connection[Any]]:
    """The task's row locked FOR UPDATE in a transaction of this test's, until the block ends."""
    with psycopg.connect(database_url()) as holder:
        holder.execute("SELECT 1 FROM tasks_app_task WHERE id = %s FOR UPDATE", [task_id])
        yield holder
        holder.rollback()


class InBackground:
    """One request on its own thread: it waits for the lock while the test acts on its session."""

    def __init__(self, send: Any) -> None:
        self.response: httpx.Response | None = None
        self._thread = threading.Thread(target=self._run, args=(send,), daemon=True)
        self._thread.start()

    def _run(self, send: Any) -> None:
        self.response = send()

    def result(self) -> httpx.Response:
        self._thread.join(timeout=60)
        assert self.response is not None, "the request got no answer"
        return self.response


def waiting_pid(look: psycopg.Connection[Any], query: str = WAITING_FOR_THE_LOCK) -> int | None:
    row = look.execute(query, [WEB]).fetchone()
    return row[0] if row else None


def assert_unavailable(response: httpx.Response, cause: str) -> None:
    assert response.status_code == 503, response.text
    assert int(response.headers["Retry-After"]) > 0
    error = response.json()["error"]
    assert error["code"] == "unavailable" and cause in error["message"], error


def test_a_request_whose_session_is_terminated_mid_transaction_is_a_503_naming_it(alice, processes: Processes):
    web = start_web(processes)
    task = new_task(alice, steps=3)  # no worker: it stays queued, and a cancel locks its row
    auth = {"Authorization": f"Bearer {alice.token}"}
    with psycopg.connect(database_url(), autocommit=True) as look, row_locked(task.id):
        cancel = InBackground(lambda: web.post(f"/runtime/tasks/{task.id}/cancel", json={}, headers=auth))
        pid = wait_until(lambda: waiting_pid(look), timeout=30, what="the cancel to wait for the row's lock")
        look.execute("SELECT pg_terminate_backend(%s)", [pid])
        assert_unavailable(cancel.result(), "the database ended the session")
    again = web.post(f"/runtime/tasks/{task.id}/cancel", json={}, headers=auth)
    assert again.status_code == 202 and again.json()["runtimeStatus"] == "cancelled", again.text


@pytest.mark.parametrize(
    ("options", "cause"),
    [
        ("-c statement_timeout=1000", "the database statement timed out"),
        ("-c lock_timeout=1000", "a database lock was not available in time"),
    ],
)
def test_a_request_the_server_gives_up_on_mid_transaction_is_a_503_naming_why(
    alice, processes: Processes, options, cause
):
    web = start_web(processes, options)
    task = new_task(alice, steps=3)
    auth = {"Authorization": f"Bearer {alice.token}"}
    with row_locked(task.id):
        assert_unavailable(web.post(f"/runtime/tasks/{task.id}/cancel", json={}, headers=auth), cause)
        # /mcp's twin: -32003 naming the cause, HTTP 503 with Retry-After, its request's id kept.
        cancel = {"jsonrpc": "2.0", "id": 7, "method": "tasks/cancel", "params": {"taskId": str(task.id)}}
        answer = web.post("/mcp", json=cancel, headers=auth)
        assert answer.status_code == 503 and int(answer.headers["Retry-After"]) > 0, answer.text
        assert answer.json()["id"] == 7 and answer.json()["error"]["code"] == -32003, answer.text
        assert cause in answer.json()["error"]["message"], answer.text
    again = web.post(f"/runtime/tasks/{task.id}/cancel", json={}, headers=auth)
    assert again.status_code == 202 and again.json()["runtimeStatus"] == "cancelled", again.text


def test_a_request_stopped_inside_its_transaction_past_the_idle_timeout_is_a_503_naming_it(alice, processes: Processes):
    """The web process stopped (SIGSTOP: a paused VM) just as its cancel got the row's lock:
    its session sat idle in the transaction, holding the lock, until PostgreSQL ended it
    (idle_in_transaction_session_timeout, settings.py). Running again, the request finds its
    session gone at its next statement."""
    web = start_web(processes, RUNTIME_DB_IDLE_IN_TRANSACTION_SECONDS="1")
    task = new_task(alice, steps=3)
    auth = {"Authorization": f"Bearer {alice.token}"}
    group = processes.procs[-1].pid  # uvicorn, the leader of its own process group
    with psycopg.connect(database_url(), autocommit=True) as look:
        with row_locked(task.id):
            cancel = InBackground(lambda: web.post(f"/runtime/tasks/{task.id}/cancel", json={}, headers=auth))
            pid = wait_until(lambda: waiting_pid(look), timeout=30, what="the cancel to wait for the row's lock")
            os.killpg(group, signal.SIGSTOP)
        try:  # the lock is free: the session takes it and waits, idle, for its stopped client
            wait_until(
                lambda: waiting_pid(look, IDLE_IN_A_TRANSACTION) == pid,
                timeout=30,
                what="the stopped web's session to sit idle in its transaction",
            )
            wait_until(
                lambda: not look.execute("SELECT 1 FROM pg_stat_activity WHERE pid = %s", [pid]).fetchone(),
                timeout=30,
                what="PostgreSQL to end the session idle in its transaction",
            )
        finally:
            os.killpg(group, signal.SIGCONT)
    assert_unavailable(cancel.result(), "idle in a transaction")
    again = web.post(f"/runtime/tasks/{task.id}/cancel", json={}, headers=auth)
    assert again.status_code == 202 and again.json()["runtimeStatus"] == "cancelled", again.text


def test_an_open_stream_whose_recheck_the_database_times_out_ends_with_an_unavailable_event(
    alice, processes: Processes
):
    """An open event stream asks every second whether its key still works; the key's table is
    locked (a migration, say) past the web's statement_timeout. The stream ends with an
    `unavailable` event naming the cause, never as if the key were revoked, and once the
    lock is gone the stream opens again."""
    web = start_web(processes, "-c statement_timeout=1000", STREAM_AUTH_RECHECK_SECONDS="1")
    task = new_task(alice, steps=3)  # no worker: the stream only waits
    url = str(web.base_url.join(f"/runtime/tasks/{task.id}/events"))
    stream = SseClient(url, alice.token)
    wait_until(
        lambda: stream.of("task.snapshot"),
        timeout=20,
        what=lambda: f"the stream to open, not {stream.status} {stream.events} {url}",
    )
    with psycopg.connect(database_url()) as holder:
        holder.execute("LOCK TABLE tasks_app_apikey IN ACCESS EXCLUSIVE MODE")  # held until the block ends
        wait_until(lambda: not stream.live, timeout=30, what="the stream to end")
        holder.rollback()
    (ended,) = stream.of("unavailable")
    assert ended["data"]["error"] == {
        "code": "unavailable",
        "message": "the database statement timed out; retry shortly",
    }
    assert ended["retry"] == "2000"
    again = SseClient(url, alice.token)
    wait_until(lambda: again.of("task.snapshot"), timeout=20, what="the stream to open again")
    again.close()
