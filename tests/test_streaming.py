"""Live progress over SSE with real uvicorn and Celery worker processes and a real SSE client."""

from __future__ import annotations

import time

import pytest
from django.db import connection

from conftest import FAST_LEASES, Processes, SseClient, database_url, free_port, wait_until
from steering_app.actions import do_enqueue_command
from tasks_app import engine
from tasks_app.access import console
from tasks_app.actions import do_create_task
from tasks_app.models import Task, TaskEvent

pytestmark = pytest.mark.django_db(transaction=True)

FAST = {**FAST_LEASES, "RUNTIME_STALL_SECONDS": "3", "RUNTIME_SLICE_STEPS": "8", "STREAM_PROGRESS_INTERVAL_MS": "0"}


def web_and_worker(processes: Processes, web_env: dict[str, str] | None = None, **env: str) -> str:
    port = free_port()
    processes.web(port, **{**env, **(web_env or {})})
    processes.worker(concurrency=2, **{**FAST, **env})
    processes.beat(**{**FAST, **env})
    return f"http://127.0.0.1:{port}"


def events_url(base: str, task: Task | str) -> str:
    return f"{base}/runtime/tasks/{getattr(task, 'id', task)}/events"


def assert_no_gap(client: SseClient, task_id, after: int) -> None:
    """Every stored event after `after` reached the client, in seq order, after de-duplication."""
    received = [e["data"]["seq"] for e in client.deduplicated()]
    assert received == sorted(set(received))
    stored = list(
        TaskEvent.objects.filter(task_id=task_id, seq__gt=after).order_by("seq").values_list("seq", flat=True)
    )
    assert [s for s in received if s > after] == stored


def test_the_stream_starts_with_a_snapshot_and_then_carries_every_event_in_order(alice, processes):
    base = web_and_worker(processes)
    task, _ = do_create_task(console(alice.tenant, "user:test"), agent="noop", input={"steps": 40, "sleepMs": 30})
    client = SseClient(events_url(base, task), alice.token)
    wait_until(lambda: client.of("terminal"), timeout=60, what="the terminal event")
    client.close()
    first = client.events[0]
    assert first["type"] == "task.snapshot" and first["data"]["taskId"] == str(task.id)
    assert first["id"].endswith(f":{first['data']['seq']}")
    types = {e["type"] for e in client.deduplicated()}
    assert {"progress", "checkpoint", "terminal"} <= types
    assert_no_gap(client, task.id, first["data"]["seq"])


def test_a_client_that_reconnects_gets_a_fresh_snapshot_and_then_live_events(alice, processes):
    base = web_and_worker(processes)
    task, _ = do_create_task(console(alice.tenant, "user:test"), agent="noop", input={"steps": 60, "sleepMs": 50})
    first = SseClient(events_url(base, task), alice.token)
    wait_until(lambda: len(first.of("progress")) >= 3, timeout=30, what="some progress")
    first.close()
    seen = first.deduplicated()[-1]
    away_at = Task.objects.get(id=task.id).steps_done
    wait_until(
        lambda: Task.objects.get(id=task.id).steps_done >= away_at + 10,
        timeout=30,
        what="the task to move on while the client is away",
    )
    second = SseClient(events_url(base, task), alice.token, last_event_id=seen["id"])
    wait_until(lambda: second.of("terminal"), timeout=60, what="the terminal event after reconnecting")
    second.close()
    snapshot = second.events[0]
    assert snapshot["type"] == "task.snapshot"
    assert snapshot["data"]["seq"] > seen["data"]["seq"] and snapshot["data"]["stepsDone"] >= away_at + 10
    assert_no_gap(second, task.id, snapshot["data"]["seq"])
    task.refresh_from_db()
    assert task.status == "completed" and task.result == {"steps": 60}  # the task never noticed


def test_another_tenant_is_refused_and_learns_nothing(alice, mallory, processes):
    base = web_and_worker(processes)
    task, _ = do_create_task(console(alice.tenant, "user:test"), agent="noop", input={"steps": 3})
    import httpx

    stranger = httpx.get(events_url(base, task), headers={"Authorization": f"Bearer {mallory.token}"}, timeout=10)
    nobody = httpx.get(
        events_url(base, "not-even-a-uuid"), headers={"Authorization": f"Bearer {mallory.token}"}, timeout=10
    )
    assert (
        (stranger.status_code, stranger.json())
        == (nobody.status_code, nobody.json())
        == (404, {"error": {"code": "not_found", "message": "no such task"}})
    )
    assert httpx.get(events_url(base, task), timeout=10).status_code == 401


def web_backends() -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE application_name = 'sse-web'")
        return cursor.fetchone()[0]


def test_open_streams_hold_no_database_connection(alice, processes):
    # The web process names its connections, so only its own are counted. Without its pool
    # (which would cap the count whatever the streams do), a stream that kept its
    # connection would show as one of 20 backends. While events flow, each stream reads
    # storage for a moment (up to one thread pool's worth at once, more the busier the
    # machine), so the count is taken once the task is paused and nothing flows.
    base = web_and_worker(
        processes, web_env={"DATABASE_URL": database_url() + "?application_name=sse-web", "RUNTIME_DB_POOL": "false"}
    )
    task, _ = do_create_task(console(alice.tenant, "user:test"), agent="noop", input={"steps": 400, "sleepMs": 50})
    wait_until(lambda: Task.objects.get(id=task.id).steps_done > 2, timeout=30, what="the task to run")
    clients = [SseClient(events_url(base, task), alice.token) for _ in range(20)]
    wait_until(lambda: all(len(c.of("progress")) >= 2 for c in clients), timeout=60, what="every stream to be live")
    do_enqueue_command(
        task.id,
        who=console(alice.tenant, "user:test"),
        command_id="quiet",
        type="pause",
        payload={},
        expected_version=Task.objects.get(id=task.id).state_version,
    )
    wait_until(lambda: Task.objects.get(id=task.id).status == "paused", timeout=60, what="the task to pause")
    paused_seq = Task.objects.get(id=task.id).event_seq
    wait_until(
        lambda: all(any(e["data"].get("seq") == paused_seq for e in c.events) for c in clients),
        timeout=60,
        what="every stream to carry the pause",
    )
    wait_until(lambda: web_backends() == 0, timeout=30, what="the streams' reads to give their connections back")
    held = [web_backends() for _ in range(10)]
    import httpx

    snapshot = httpx.get(
        f"{base}/runtime/tasks/{task.id}", headers={"Authorization": f"Bearer {alice.token}"}, timeout=10
    )
    assert all(c.live for c in clients), "a stream ended while the task was paused"
    for c in clients:
        c.close()
    assert held == [0] * 10, f"the web process holds {max(held)} database connections with 20 idle open streams"
    assert snapshot.status_code == 200  # and it still answers other requests


def test_after_a_redis_restart_events_flow_again_without_restarting_the_web_process(alice, processes, private_redis):
    port, start_redis = private_redis
    redis_proc = start_redis()
    base = web_and_worker(processes, REDIS_URL=f"redis://127.0.0.1:{port}/0")
    import httpx

    created = httpx.post(
        f"{base}/runtime/tasks",
        json={"agent": "noop", "input": {"steps": 80, "sleepMs": 50}},
        headers={"Authorization": f"Bearer {alice.token}"},
        timeout=10,
    ).json()
    client = SseClient(events_url(base, created["taskId"]), alice.token)
    wait_until(lambda: len(client.of("progress")) >= 3, timeout=30, what="live events before the outage")
    processes.kill(redis_proc)
    before_outage = client.deduplicated()[-1]["data"]["seq"]
    time.sleep(2)  # the outage itself: its length is the fault being injected, not a wait
    start_redis()
    wait_until(lambda: client.of("terminal"), timeout=90, what="events to flow again after the restart")
    client.close()
    assert client.deduplicated()[-1]["data"]["seq"] > before_outage + 5
    assert_no_gap(client, created["taskId"], client.events[0]["data"]["seq"])


def test_deployments_sharing_a_redis_never_see_each_others_events(alice, processes):
    ours = web_and_worker(processes)
    other_port = free_port()
    processes.web(other_port, RUNTIME_DEPLOYMENT="another-deployment")
    task, _ = do_create_task(console(alice.tenant, "user:test"), agent="noop", input={"steps": 30, "sleepMs": 40})
    # Both web processes read the same database here (real deployments do not), so the
    # other one may see stored events when it connects; what it must never get is our
    # pub/sub traffic, which would carry it live to the end.
    theirs = SseClient(events_url(f"http://127.0.0.1:{other_port}", task), alice.token)
    mine = SseClient(events_url(ours, task), alice.token)
    wait_until(lambda: mine.of("terminal"), timeout=60, what="our stream to finish")
    wait_until(lambda: theirs.events, timeout=10, what="the other stream's snapshot")
    mine.close(), theirs.close()
    assert len(mine.deduplicated()) > 10
    assert theirs.events[0]["type"] == "task.snapshot"
    assert not theirs.of("terminal") and len(theirs.events) < len(mine.events) / 2


def test_progress_of_a_fast_task_is_coalesced_and_the_latest_value_is_delivered(alice, settings):
    settings.RUNTIME = {**settings.RUNTIME, "stream": {**settings.RUNTIME["stream"], "progress_interval_ms": 250}}
    settings.RUNTIME_SLICE_STEPS = 1000
    task, _ = do_create_task(console(alice.tenant, "user:test"), agent="noop", input={"steps": 300})
    started = time.monotonic()
    while engine.run_slice(task.id, worker_id="w") is engine.SliceOutcome.CONTINUE:
        pass
    elapsed = time.monotonic() - started
    progress = list(TaskEvent.objects.filter(task=task, type="progress").order_by("seq"))
    assert len(progress) <= 2 + elapsed / 0.25, (len(progress), elapsed)  # not one per step
    assert len(progress) < 300
    assert progress[-1].data["progress"] == 1.0


def test_many_streams_share_one_subscription_and_a_few_database_connections(alice, processes, private_redis):
    """Sixty streams of one task on one web process: they connect at once, through one
    pub/sub subscription, and every stream carries every event. Their snapshot reads and
    the task's catch-up reads share the web process's small event-loop pool
    (RUNTIME_DB_ASYNC_POOL_MAX, 4); beside it the sync pool keeps the two it opens at boot
    (RUNTIME_DB_POOL_MIN), and a third while the credential recheck (a thread, every few
    seconds) meets the request that answers the question. Each connecting stream held one of the sync pool's 20
    before (issue 14: 500 streams, 20 connections)."""
    import threading

    import httpx
    import psycopg
    import redis

    port, start_redis = private_redis
    start_redis()
    base = web_and_worker(
        processes,
        web_env={"DATABASE_URL": database_url() + "?application_name=sse-many"},
        REDIS_URL=f"redis://127.0.0.1:{port}/0",
    )
    auth = {"Authorization": f"Bearer {alice.token}"}
    created = httpx.post(
        f"{base}/runtime/tasks", json={"agent": "noop", "input": {"steps": 30, "sleepMs": 30, "askAt": 1}}, headers=auth
    ).json()
    task_id = created["taskId"]
    wait_until(lambda: Task.objects.get(id=task_id).status == "input_required", timeout=30, what="the question")

    held: list[int] = []
    sampling = threading.Event()

    def sample() -> None:
        with psycopg.connect(database_url(), autocommit=True) as conn:
            while not sampling.is_set():
                query = "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'sse-many'"
                held.append(conn.execute(query).fetchone()[0])
                sampling.wait(0.02)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        clients = [SseClient(events_url(base, task_id), alice.token) for _ in range(60)]
        wait_until(lambda: all(c.of("task.snapshot") for c in clients), timeout=60, what="every stream's snapshot")
        subscriptions = redis.Redis(port=port).pubsub_numsub("events_channel")[0][1]
        answered = httpx.post(f"{base}/runtime/tasks/{task_id}/inputs/continue", json={"answer": True}, headers=auth)
        assert answered.status_code == 202, answered.text
        wait_until(lambda: all(c.of("terminal") for c in clients), timeout=90, what="every stream's terminal event")
    finally:
        sampling.set()
        sampler.join()
    for client in clients:
        client.close()
        assert_no_gap(client, task_id, client.events[0]["data"]["seq"])
    assert subscriptions == 1  # the web process's; the worker only publishes
    assert max(held) <= 7, f"the web process held {max(held)} database connections"
