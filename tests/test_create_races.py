"""Creates that race each other on a real web process (uvicorn), over HTTP.

Two creates with the same Idempotency-Key, sent at the same moment while the tenant has one
place left in its queue (limits.queued_tasks_per_tenant): both missed the key before the
queue cap's lock, the first took the place, and the second, counting under the lock, found
the queue full and answered 429, for a key whose task the first had just created. Found by
the adv2 adversary. The second now looks the key up again under the lock and answers as the
replay it is.

The race is made to happen every time rather than hoped for: another session holds the
tenant's row as the cap's lock does (FOR NO KEY UPDATE) until both creates wait for it.
"""

from __future__ import annotations

import threading
from typing import Any

import httpx
import psycopg
import pytest
from django.db import connection

from conftest import Persona, Processes, database_url, free_port, wait_until
from tasks_app.models import Task

pytestmark = pytest.mark.django_db(transaction=True)  # the web process must see what the test writes

CAP = 2
ROUNDS = 3
BODY = {"agent": "noop", "input": {"steps": 1}}


def waiting_for_a_lock() -> int:
    """How many sessions of the test database wait for a lock (only the web process's
    creates, here: on the tenant's row, the queue cap's lock)."""
    with psycopg.connect(database_url(), autocommit=True) as probe:
        row = probe.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = %s AND wait_event_type = 'Lock'",
            [connection.settings_dict["NAME"]],
        ).fetchone()
    return int(row[0]) if row else 0


def test_two_creates_with_one_key_at_the_last_place_in_the_queue_both_get_its_task(
    alice: Persona, processes: Processes
) -> None:
    port = free_port()
    processes.web(
        port, LIMITS_QUEUED_TASKS_PER_TENANT=str(CAP), LIMITS_REST_PER_KEY="0", LIMITS_REST_PER_TENANT="0"
    )  # and no worker: what is created stays queued
    headers = {"Authorization": f"Bearer {alice.token}"}
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", headers=headers, timeout=60) as http:
        for n in range(ROUNDS):
            # One place left: CAP - 1 queued.
            Task.objects.filter(tenant=alice.tenant, status="queued").update(status="working")
            for _ in range(CAP - 1):
                assert http.post("/runtime/tasks", json=BODY).status_code == 201
            key = f"same-{n}"
            answers: list[Any] = [None, None]

            def create(slot: int, key: str = key, answers: list[Any] = answers) -> None:
                with httpx.Client(base_url=f"http://127.0.0.1:{port}", headers=headers, timeout=60) as own:
                    answers[slot] = own.post("/runtime/tasks", json=BODY, headers={"Idempotency-Key": key})

            with psycopg.connect(database_url()) as other:
                # The cap's lock, held until both creates wait for it: each has looked the key
                # up (before the lock) and found nothing.
                other.execute("SELECT 1 FROM tasks_app_tenant WHERE id = %s FOR NO KEY UPDATE", [alice.tenant.id])
                threads = [threading.Thread(target=create, args=(slot,)) for slot in (0, 1)]
                for thread in threads:
                    thread.start()
                try:
                    wait_until(
                        lambda: waiting_for_a_lock() >= 2,
                        timeout=60,
                        what="both creates to wait for the queue cap's lock",
                    )
                finally:
                    other.commit()
                for thread in threads:
                    thread.join(90)
            statuses = sorted(answer.status_code for answer in answers)
            assert statuses == [200, 201], [(a.status_code, a.text) for a in answers]
            assert answers[0].json()["taskId"] == answers[1].json()["taskId"]
            assert Task.objects.filter(tenant=alice.tenant, idempotency_key=key).count() == 1
            assert Task.objects.filter(tenant=alice.tenant, status="queued").count() == CAP
        # A third create with the key, the queue full: still its replay.
        again = http.post("/runtime/tasks", json=BODY, headers={"Idempotency-Key": key})
        assert again.status_code == 200 and again.json()["taskId"] == answers[0].json()["taskId"]
        # Another key at the full queue: refused.
        refused = http.post("/runtime/tasks", json=BODY, headers={"Idempotency-Key": "another"})
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "quota_exceeded"
