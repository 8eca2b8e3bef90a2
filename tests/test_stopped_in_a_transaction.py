"""A worker stopped (SIGSTOP: a paused VM, a host that hangs) while inside a transaction that
holds its task's row: the row's lock was held for as long as the worker stayed stopped, so
the task could be neither killed nor cancelled (each a 503 after the web's deadline) and the
reaper's scan waited behind it, however long ago the lease ran out. PostgreSQL now ends a
session idle in a transaction past a lease (settings: idle_in_transaction_session_timeout),
which releases the lock: the kill lands, and the worker, running again, commits nothing."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import httpx
import psycopg
import pytest

from conftest import FAST_LEASES, Processes, database_url, free_port, wait_until

pytestmark = pytest.mark.django_db(transaction=True)

FROZEN = "stopped-worker"  # the application_name of the worker to stop
# That worker's session, idle in a transaction that holds a lock on a task's row.
IN_A_TRANSACTION = """
SELECT 1 FROM pg_stat_activity a
 WHERE a.datname = current_database() AND a.application_name = %s AND a.state = 'idle in transaction'
   AND EXISTS (SELECT 1 FROM pg_locks l WHERE l.pid = a.pid AND l.relation = 'tasks_app_task'::regclass)
"""
RUNNING = (
    "SELECT 1 FROM pg_stat_activity WHERE datname = current_database() AND application_name = %s AND state = 'active'"
)


def test_a_task_whose_worker_stopped_inside_a_transaction_can_be_killed(alice, processes: Processes):
    port = free_port()
    processes.web(port, RUNTIME_DB_QUERY_SECONDS="3", LIMITS_REST_PER_KEY="0", LIMITS_REST_PER_TENANT="0")
    env = {**FAST_LEASES, "RUNTIME_SLICE_STEPS": "1"}
    worker = processes.worker(**env, ready=True, DATABASE_URL=f"{database_url()}?application_name={FROZEN}")
    http = httpx.Client(base_url=f"http://127.0.0.1:{port}", headers={"Authorization": f"Bearer {alice.token}"})
    http.timeout = httpx.Timeout(30)
    task_id = http.post("/runtime/tasks", json={"agent": "noop", "input": {"steps": 100000}}).json()["taskId"]

    def steer_back_and_forth(stop: threading.Event) -> None:
        """Pause, resume, pause ...: the worker applies each pause in a transaction of several statements."""
        for n in range(100000):
            if stop.is_set():
                return
            task = http.get(f"/runtime/tasks/{task_id}").json()
            kind = "resume" if task["runtimeStatus"] in ("paused", "pausing") else "pause"
            body = {"commandId": f"c{n}", "type": kind, "payload": {}, "expectedVersion": task["stateVersion"]}
            http.post(f"/runtime/tasks/{task_id}/steering", json=body)

    with psycopg.connect(database_url(), autocommit=True) as db:
        stop = threading.Event()
        steering = threading.Thread(target=steer_back_and_forth, args=(stop,))
        steering.start()
        try:

            def stopped_inside_a_transaction() -> bool:
                if not db.execute(IN_A_TRANSACTION, [FROZEN]).fetchone():
                    return False
                os.killpg(worker.pid, signal.SIGSTOP)
                # A statement it sent before the stop ends; then its session stays as it is.
                wait_until(
                    lambda: not db.execute(RUNNING, [FROZEN]).fetchone(), timeout=10, what="its last statement to end"
                )
                if db.execute(IN_A_TRANSACTION, [FROZEN]).fetchone():
                    return True
                os.killpg(worker.pid, signal.SIGCONT)  # it had committed meanwhile: again
                return False

            wait_until(
                stopped_inside_a_transaction, timeout=90, interval=0.005, what="the worker stopped mid-transaction"
            )
        finally:
            stop.set()
            steering.join()
        try:
            began, answers = time.monotonic(), []
            while time.monotonic() - began < 30:
                version = http.get(f"/runtime/tasks/{task_id}").json()["stateVersion"]
                kill = {"commandId": f"kill-{len(answers)}", "type": "kill", "payload": {}, "expectedVersion": version}
                answer = http.post(f"/runtime/tasks/{task_id}/steering", json={**kill, "reason": "its host hangs"})
                answers.append((round(time.monotonic() - began, 1), answer.status_code))
                if answer.status_code != 503:
                    break
            assert answers[-1][1] == 202, answers
            steps = db.execute("SELECT status, steps_done FROM tasks_app_task WHERE id = %s", [task_id]).fetchone()
            assert steps[0] == "cancelled", steps
        finally:
            os.killpg(worker.pid, signal.SIGCONT)
        # Running again, the worker finds its session ended: nothing more of it commits.
        log = Path(worker.log_path)  # type: ignore[attr-defined]
        wait_until(
            lambda: "slice abandoned" in log.read_text(errors="replace"), timeout=30, what="the worker's next write"
        )
        row = db.execute("SELECT status, steps_done FROM tasks_app_task WHERE id = %s", [task_id]).fetchone()
        assert row == steps, (row, steps)
