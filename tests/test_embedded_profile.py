"""The embedded default end to end: SQLite + filesystem broker + local blobs, no PostgreSQL
or Redis, with real uvicorn, worker and beat processes and a real HTTP client."""

from __future__ import annotations

import base64
import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import uuid
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

from conftest import ROOT, Processes, SseClient, free_port, wait_until
from tests.test_blob_stores import SmallDisk

EMBEDDED = {
    "DATABASE_URL": None,
    "REDIS_URL": None,
    "DJANGO_SECRET_KEY": None,
    "RUNTIME_LEASE_SECONDS": "4",
    "RUNTIME_HEARTBEAT_SECONDS": "1",
    "RUNTIME_SCAN_SECONDS": "1",
}
# A task not yet ended, as the API's runtimeStatus says.
ACTIVE = ("queued", "working", "recovering")


@pytest.fixture
def embedded_site(tmp_path: Path, processes: Processes):
    """The database, a key and the web process; the test starts its workers itself."""
    data = tmp_path / "data"
    env = {**EMBEDDED, "RUNTIME_DATA_DIR": str(data)}

    def manage(*args: str) -> str:
        out = subprocess.run(
            [sys.executable, "manage.py", *args],
            cwd=ROOT,
            env=processes.env(**env),
            capture_output=True,
            text=True,
            check=False,
            timeout=120,
        )
        assert out.returncode == 0, out.stderr
        return out.stdout.strip()

    manage("migrate", "-v0")
    assert (data / "runtime.sqlite3").exists()
    key = manage("create_demo", "--key-only")
    port = free_port()
    processes.web(port, **env)
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", headers={"Authorization": f"Bearer {key}"}, timeout=10)
    return client, manage, data, f"http://127.0.0.1:{port}", key, env


@pytest.fixture
def embedded(embedded_site, processes: Processes):
    client, manage, data, base, key, env = embedded_site
    worker = processes.worker(concurrency=2, **env)
    processes.beat(**env)
    return client, manage, data, base, key, worker


def test_the_embedded_profile_runs_a_task_end_to_end(embedded):
    client, manage, data, _, _, _ = embedded
    created = client.post(
        "/runtime/tasks",
        json={"agent": "noop", "input": {"steps": 30, "sleepMs": 5}},
        headers={"Idempotency-Key": "embedded-1"},
    )
    assert created.status_code == 201, created.text
    task_id = created.json()["taskId"]
    snapshot = wait_until(
        lambda: (s := client.get(f"/runtime/tasks/{task_id}").json())["status"] == "completed" and s,
        timeout=60,
        what="the task to complete on the embedded profile",
    )
    assert snapshot["stepsDone"] == 30 and snapshot["lastCheckpoint"] == 30
    assert client.get(f"/runtime/tasks/{task_id}/result").json()["result"] == {"steps": 30}
    assert "0 broken" in manage("verify_audit")
    assert (data / "broker" / "queue").is_dir()  # the filesystem broker carried the messages


def test_the_embedded_profile_streams_a_workers_events_across_processes(embedded):
    client, _, _, base, key, _ = embedded
    task_id = client.post("/runtime/tasks", json={"agent": "noop", "input": {"steps": 25, "sleepMs": 40}}).json()[
        "taskId"
    ]
    stream = SseClient(f"{base}/runtime/tasks/{task_id}/events", key)
    wait_until(lambda: stream.of("terminal"), timeout=60, what="the worker's events to reach the web process")
    stream.close()
    events = stream.deduplicated()
    assert events[0]["type"] == "task.snapshot"
    seqs = [e["data"]["seq"] for e in events]
    assert seqs == list(range(seqs[0], seqs[-1] + 1))  # no redis, still no gap
    assert {"progress", "checkpoint"} <= {e["type"] for e in events}


def test_a_file_that_is_no_whole_message_neither_stops_the_worker_nor_the_work(embedded):
    """A file in the queue that is no whole message is set aside. A half message is what kombu's
    own filesystem transport left when its sender was killed between creating the file and
    writing it, and what a reader saw in that moment. Whole JSON is not yet a message: kombu
    builds one outside any handler, and `[]`, `{}` or a message without its delivery tag ended
    the worker (an unrecoverable TypeError or KeyError), as did a folder under a message's
    name (the transport's ChannelError). Each of these killed the worker that read it
    (runtime_site/brokerfs.py). A whole message whose body is in a content type the worker
    refuses reached the pool and was gone as a failed run: it is set aside too, as a copy
    (runtime_site/patches/consumer.py), and its taken file is done with."""
    client, _, data, _, _, worker = embedded
    queue = data / "broker" / "queue"
    pickled = {
        "body": base64.b64encode(b"not really a pickle").decode(),
        "content-type": "application/x-python-serialize",
        "content-encoding": "binary",
        "headers": {"task": "tasks.run_task_slice", "id": str(uuid.uuid4())},
        "properties": {
            "delivery_tag": str(uuid.uuid4()),
            "body_encoding": "base64",
            "delivery_info": {"exchange": "", "routing_key": "steps"},
        },
    }
    (queue / "00000000000000000007_pickled.steps.msg").write_text(json.dumps(pickled))
    junk = {
        "00000000000000000001_half.steps.msg": b'{"body": "eyJ',
        "00000000000000000002_empty.steps.msg": b"",
        "00000000000000000003_list.steps.msg": b"[]",
        "00000000000000000004_dict.steps.msg": b"{}",
        "00000000000000000005_tagless.steps.msg": b'{"body": "", "properties": {}}',
    }
    for name, content in junk.items():
        (queue / name).write_bytes(content)
    (queue / "00000000000000000006_folder.steps.msg").mkdir()
    wait_until(lambda: not any(queue.glob("0000000000000000000*")), timeout=30, what="the worker to take the files")
    task_id = client.post("/runtime/tasks", json={"agent": "noop", "input": {"steps": 3}}).json()["taskId"]
    wait_until(
        lambda: client.get(f"/runtime/tasks/{task_id}").json()["status"] == "completed",
        timeout=60,
        what="the task to complete after the junk files",
    )
    assert worker.poll() is None, "the worker died"
    processed = data / "broker" / "processed"
    copies = [p for p in processed.iterdir() if not p.name.startswith("0000000000000000000")]
    assert sorted(p.name for p in processed.iterdir() if p not in copies) == sorted(
        [*(f"{name}.unreadable" for name in junk), "00000000000000000006_folder.steps.msg.unreadable"]
    )
    [copy] = copies
    assert copy.name.endswith(".steps.msg.unreadable") and json.loads(copy.read_bytes()) == pickled
    # The task's last message is acknowledged (its taken file removed) after its slice commits
    # the completion the wait above saw: a moment later, not at once.
    wait_until(
        lambda: not any(p.name.startswith(".taken-") for p in queue.iterdir()),
        timeout=30,
        what="no message left taken",
    )


def test_a_message_whose_worker_was_killed_mid_run_is_run_by_another_worker(embedded_site, processes: Processes):
    """At least once on the filesystem broker (runtime_site/brokerfs.py): the worker that took
    the task's message is killed (SIGKILL) in the middle of running it, and another worker
    runs that same message. kombu's transport deleted a message's file as it read it: with
    no beat here to re-find the task from the database, it never completed. The engine's
    lease makes the second run exactly once in effect: it resumes from the checkpoint."""
    client, _, data, _, _, env = embedded_site
    env = {**env, "RUNTIME_SLICE_STEPS": "1000"}  # the whole task is one slice: one message
    queue = data / "broker" / "queue"
    first = processes.worker(ready=True, **env)
    task_id = client.post("/runtime/tasks", json={"agent": "noop", "input": {"steps": 60, "sleepMs": 100}}).json()[
        "taskId"
    ]
    wait_until(lambda: client.get(f"/runtime/tasks/{task_id}").json()["stepsDone"] >= 15, timeout=60, what="15 steps")
    [held] = [p.name for p in queue.iterdir() if p.name.startswith(".taken-")]
    assert held.startswith(f".taken-{first.pid}-"), held  # the killed worker holds the message
    processes.kill(first)
    killed_at = client.get(f"/runtime/tasks/{task_id}").json()
    assert killed_at["status"] == "working" and killed_at["stepsDone"] < 60, killed_at
    checkpoint = killed_at["lastCheckpoint"]
    assert checkpoint >= 10, killed_at

    db = sqlite3.connect(data / "runtime.sqlite3", timeout=20)
    row_id = uuid.UUID(task_id).hex  # Django keeps a UUID as 32 hex digits in SQLite
    # Only then the second worker: a run of the message while the dead worker's lease
    # still held would be dropped by the claim, and nothing (no beat) would ring again.
    wait_until(lambda: lease_expired(db, row_id), timeout=30, what="the killed worker's lease to expire")
    second = processes.worker(**env)
    wait_until(
        lambda: client.get(f"/runtime/tasks/{task_id}").json()["status"] == "completed",
        timeout=90,
        what="the task to complete from the message its killed worker held",
    )
    assert client.get(f"/runtime/tasks/{task_id}/result").json()["result"] == {"steps": 60}
    # Taking the task over from its dead worker was a recovery, counted by the second worker.
    assert client.get(f"/runtime/tasks/{task_id}").json()["recoveries"] == 1
    log = Path(second.log_path).read_text(errors="replace")  # type: ignore[attr-defined]
    assert f"{held.split('-', 2)[2]} was taken by reader {first.pid}, which is gone; put back" in log, log[-4000:]
    assert f"task {task_id}: worker lost (lease of " in log, log[-4000:]
    steps = db.execute("SELECT sequence, attempt FROM tasks_app_step WHERE task_id = ?", [row_id]).fetchall()
    runs = Counter(sequence for sequence, _ in steps)
    assert sorted(runs) == list(range(1, 61))
    assert all(runs[s] == 1 for s in range(1, checkpoint + 1))  # nothing up to the checkpoint ran twice
    assert all(n <= 2 for n in runs.values())
    assert {s for s, attempt in steps if attempt == 2} == set(range(checkpoint + 1, killed_at["stepsDone"] + 1))
    wait_until(
        lambda: not any(p.name.startswith(".taken-") for p in queue.iterdir()),
        timeout=30,
        what="no message left taken",
    )


def lease_expired(db: sqlite3.Connection, row_id: str) -> bool:
    (expires,) = db.execute("SELECT lease_expires_at FROM tasks_app_task WHERE id = ?", [row_id]).fetchone()
    return expires is None or datetime.fromisoformat(expires).replace(tzinfo=UTC) < datetime.now(UTC)


def test_a_step_that_kills_every_worker_running_it_is_held_after_max_recoveries(
    embedded_site, processes: Processes, tmp_path: Path
):
    """The filesystem broker puts the message a killed worker held back, and the next worker's
    claim took the task over from the dead worker's expired lease without counting a
    recovery: a step that kills every worker running it (an OOM kill, say) ran for ever, and
    max_recoveries was never reached. Each takeover is now a recovery, counted, and after the
    (max_recoveries + 1)th in a row the task is held for an operator. No beat: only the
    message each dead worker left hands the task on. The runs are counted by the step itself,
    in a file, before it kills its worker."""
    client, _, data, _, _, env = embedded_site
    runs = tmp_path / "runs"
    env = {**env, "RUNTIME_MAX_RECOVERIES": "1", "RUNTIME_TEST_WORKER_KILLS": str(runs)}
    task_id = client.post("/runtime/tasks", json={"agent": "kills_its_worker", "input": {}}).json()["taskId"]
    db = sqlite3.connect(data / "runtime.sqlite3", timeout=20)
    row_id = uuid.UUID(task_id).hex
    for death in (1, 2):
        worker = processes.worker(**env)
        wait_until(lambda worker=worker: worker.poll() is not None, timeout=60, what=f"the step to kill worker {death}")
        wait_until(lambda: lease_expired(db, row_id), timeout=30, what=f"the lease of dead worker {death} to expire")
    last = processes.worker(**env)  # takes the message the second dead worker held
    wait_until(
        lambda: client.get(f"/runtime/tasks/{task_id}").json()["runtimeStatus"] not in ("working", "recovering"),
        timeout=60,
        what="the task to be held or end",
    )
    task = client.get(f"/runtime/tasks/{task_id}").json()
    assert task["runtimeStatus"] == "dead_lettered" and task["recoveries"] == 2, task
    assert task["error"]["code"] == "max_recoveries_exceeded", task
    assert len(runs.read_text().split()) == 2  # one run per worker killed: the last ran no step
    assert last.poll() is None


def bin_run(processes: Processes, tmp_path: Path, port: int, **env: str) -> subprocess.Popen[bytes]:
    """bin/run as a person starts it: the embedded default, in a data folder of its own."""
    return processes.start(
        "bin-run",
        [str(ROOT / "bin" / "run")],
        DATABASE_URL=None,
        REDIS_URL=None,
        DJANGO_SECRET_KEY=None,
        RUNTIME_DATA_DIR=str(tmp_path / "data"),
        RUNTIME_VENV=sys.prefix,
        PORT=str(port),
        **env,
    )


def said(proc: subprocess.Popen[bytes]) -> str:
    return Path(proc.log_path).read_text(errors="replace")  # type: ignore[attr-defined]


def test_bin_run_says_the_runtime_is_up_only_once_it_answers(processes: Processes, tmp_path: Path):
    port = free_port()
    run = bin_run(processes, tmp_path, port)
    wait_until(
        lambda: "Runtime is up" in said(run) or run.poll() is not None, timeout=240, what=lambda: said(run)[-2000:]
    )
    assert "Runtime is up" in said(run), said(run)[-2000:]
    # Asked once, right after it said so: it used to say so before uvicorn listened.
    assert httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=10).status_code == 200


def test_bin_run_that_never_comes_up_says_why_and_stops(processes: Processes, tmp_path: Path):
    with socket.socket() as taken:  # the port is someone else's: uvicorn cannot listen there
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        run = bin_run(processes, tmp_path, taken.getsockname()[1])
        assert run.wait(timeout=240) != 0, said(run)[-2000:]
    assert "Runtime is up" not in said(run)
    assert "error: the web process exited without answering" in said(run) and "/healthz" in said(run), said(run)[-2000:]
    # and within its bound: a web process that lives but does not answer yet
    run = bin_run(processes, tmp_path, free_port(), RUNTIME_START_SECONDS="0")
    assert run.wait(timeout=240) != 0, said(run)[-2000:]
    assert "Runtime is up" not in said(run)
    assert "error: the web process did not answer" in said(run) and "within 0 s" in said(run), said(run)[-2000:]


def test_a_worker_told_to_stop_takes_no_more_messages_and_its_task_waits_for_the_next(embedded, processes: Processes):
    """The embedded broker has no socket, so Celery's loop polls it (2 s at a time) and looked
    at a SIGTERM only between polls, then polled once more: an idle worker began its warm
    shutdown 2-4 s after the signal and took whatever came meanwhile (the beat's scans, a new
    task's first slice) into a pool that was closing."""
    client, _, data, _, _, stopping = embedded
    wait_until(lambda: " ready." in said(stopping), timeout=120, what="the worker to be ready")
    os.kill(stopping.pid, signal.SIGTERM)  # the main process, as docker stop and Kubernetes do
    task_id = client.post("/runtime/tasks", json={"agent": "noop", "input": {"steps": 3}}).json()["taskId"]
    assert stopping.wait(timeout=60) == 0  # a warm shutdown that completed
    # (its first slice's message, sent after the signal; a beat's scan may be in hand as it comes)
    after_signal = said(stopping).partition("Warm shutdown")[2]
    assert "tasks.run_task_slice" not in after_signal, after_signal[-3000:]
    assert client.get(f"/runtime/tasks/{task_id}").json()["status"] == "working"  # queued, not lost
    processes.worker(
        concurrency=1,
        DATABASE_URL=None,
        REDIS_URL=None,
        DJANGO_SECRET_KEY=None,
        RUNTIME_DATA_DIR=str(data),
    )
    wait_until(
        lambda: client.get(f"/runtime/tasks/{task_id}").json()["status"] == "completed",
        timeout=90,
        what="the next worker to run the task",
    )


def test_bin_run_behind_a_proxy_whose_host_is_the_only_one_allowed_comes_up(processes: Processes, tmp_path: Path):
    """Its wait asks /healthz with Host 127.0.0.1, which DJANGO_ALLOWED_HOSTS then leaves out:
    Django's 400 for the host, and bin/run waited for a 200 until its bound and stopped it all."""
    port = free_port()
    run = bin_run(processes, tmp_path, port, DJANGO_ALLOWED_HOSTS="runtime.example.com", RUNTIME_START_SECONDS="120")
    wait_until(
        lambda: "Runtime is up" in said(run) or run.poll() is not None, timeout=240, what=lambda: said(run)[-2000:]
    )
    assert "Runtime is up" in said(run), said(run)[-2000:]
    answer = httpx.get(f"http://127.0.0.1:{port}/healthz", headers={"Host": "runtime.example.com"}, timeout=10)
    assert answer.status_code == 200, answer.text


def test_a_step_that_kills_only_its_pool_process_is_held_after_max_recoveries(
    embedded_site, processes: Processes, tmp_path: Path
):
    """The OOM killer's other pick: only the pool process running the step dies; the worker's
    main process lives, sees its child lost and puts the message back at once
    (CELERY_TASK_REJECT_ON_WORKER_LOST), while the dead child's lease still holds: that
    message is dropped, and the reaper hands the task on once the lease runs out, counted.
    Each loss once: held after max_recoveries + 1 in a row, one run per loss."""
    client, _, _, _, _, env = embedded_site
    runs = tmp_path / "runs"
    env = {**env, "RUNTIME_MAX_RECOVERIES": "2", "RUNTIME_TEST_WORKER_KILLS": str(runs)}
    worker = processes.worker(concurrency=1, **env)
    processes.beat(**env)
    task_id = client.post("/runtime/tasks", json={"agent": "kills_its_process", "input": {}}).json()["taskId"]
    wait_until(
        lambda: (
            client.get(f"/runtime/tasks/{task_id}").json()["runtimeStatus"] not in ("queued", "working", "recovering")
        ),
        timeout=120,
        what=lambda: f"the task to be held: {client.get(f'/runtime/tasks/{task_id}').json()}",
    )
    task = client.get(f"/runtime/tasks/{task_id}").json()
    assert task["runtimeStatus"] == "dead_lettered" and task["recoveries"] == 3, task
    assert len(runs.read_text().split()) == 3
    assert worker.poll() is None


@pytest.mark.parametrize("asked", ["cancel", "pause"])
def test_a_cancel_or_pause_asked_while_the_holder_is_lost_wins_and_nothing_runs_again(
    embedded_site, processes: Processes, asked: str
):
    """The worker holding the task is killed; a cancel (or a pause) is asked for while its
    dead lease still holds, so it waits for a safe point. No beat: the message the dead
    worker held comes back to the next worker, which finds the lease run out and recovers the
    task. The cancel applies there and then (nothing runs again); the pause at the first safe
    point of the slice that follows, before any step."""
    client, _, data, _, _, env = embedded_site
    env = {**env, "RUNTIME_SLICE_STEPS": "1000"}
    first = processes.worker(ready=True, **env)
    task_id = client.post("/runtime/tasks", json={"agent": "noop", "input": {"steps": 60, "sleepMs": 100}}).json()[
        "taskId"
    ]
    wait_until(lambda: client.get(f"/runtime/tasks/{task_id}").json()["stepsDone"] >= 5, timeout=60, what="5 steps")
    processes.kill(first)
    snapshot = client.get(f"/runtime/tasks/{task_id}").json()
    if asked == "cancel":
        answer = client.post(f"/runtime/tasks/{task_id}/cancel", json={"reason": "stop it"})
    else:
        answer = client.post(
            f"/runtime/tasks/{task_id}/steering",
            json={"commandId": "p1", "type": "pause", "payload": {}, "expectedVersion": snapshot["stateVersion"]},
        )
    assert answer.status_code in (200, 202), answer.text
    asked_at = client.get(f"/runtime/tasks/{task_id}").json()
    assert asked_at["runtimeStatus"] in ("working", "pausing"), asked_at  # waiting: the dead lease still holds
    db = sqlite3.connect(data / "runtime.sqlite3", timeout=20)
    row_id = uuid.UUID(task_id).hex
    wait_until(lambda: lease_expired(db, row_id), timeout=30, what="the killed worker's lease to expire")
    processes.worker(**env)
    ended = "cancelled" if asked == "cancel" else "paused"
    wait_until(
        lambda: client.get(f"/runtime/tasks/{task_id}").json()["runtimeStatus"] == ended,
        timeout=60,
        what=lambda: f"the task to be {ended}: {client.get(f'/runtime/tasks/{task_id}').json()}",
    )
    final = client.get(f"/runtime/tasks/{task_id}").json()
    steps = db.execute("SELECT COUNT(*) FROM tasks_app_step WHERE task_id = ?", [row_id]).fetchone()[0]
    assert final["stepsDone"] == asked_at["stepsDone"] and steps == asked_at["stepsDone"], (final, steps)
    assert final["recoveries"] == (0 if asked == "cancel" else 1), final


def test_two_workers_and_the_reaper_count_each_loss_of_a_step_that_kills_its_worker_once(
    embedded_site, processes: Processes, tmp_path: Path
):
    """The same poison step with beat on and two workers, each dead one replaced: the reaper
    and the worker whose message (put back by the broker, or rung by the reaper) finds the
    dead worker's lease run out race to recover it. Each loss is counted once, never twice
    (recoveries jumping by two) nor skipped: held at the (max_recoveries + 1)th, one run each."""
    client, _, _, _, _, env = embedded_site
    runs = tmp_path / "runs"
    env = {**env, "RUNTIME_MAX_RECOVERIES": "2", "RUNTIME_TEST_WORKER_KILLS": str(runs)}
    processes.beat(**env)
    workers = [processes.worker(**env), processes.worker(**env)]
    task_id = client.post("/runtime/tasks", json={"agent": "kills_its_worker", "input": {}}).json()["taskId"]

    def held() -> bool:
        for i, worker in enumerate(workers):
            if worker.poll() is not None:  # killed by the step: replaced
                workers[i] = processes.worker(**env)
        return client.get(f"/runtime/tasks/{task_id}").json()["runtimeStatus"] not in (
            "queued",
            "working",
            "recovering",
        )

    wait_until(held, timeout=180, what=lambda: f"the task to be held: {client.get(f'/runtime/tasks/{task_id}').json()}")
    task = client.get(f"/runtime/tasks/{task_id}").json()
    assert task["runtimeStatus"] == "dead_lettered" and task["recoveries"] == 3, task
    assert len(runs.read_text().split()) == 3, runs.read_text()


def test_a_full_disk_under_the_blob_folder_delays_a_review_and_never_fails_it(
    embedded_site, processes: Processes, tmp_path: Path
):
    """The local blob store's disk full as the review writes its report: the step's write
    raised the bare OSError (ENOSPC), a step failure, and the review failed for a disk that
    needed only room. It is an infrastructure fault: the slice is abandoned, counted as one
    (no lost worker), tried again after a backoff, and once there is room the review completes."""
    client, manage, data, _, _, env = embedded_site
    disk = SmallDisk(data / "blobs", size="2m")  # over the folder the web and the worker use
    try:
        manage("generate_corpus", "--prefix", "corpora/full", "--count", "30")
        disk.fill()
        processes.beat(**env)
        processes.worker(**env)
        created = client.post("/runtime/tasks", json={"agent": "document_review", "input": {"corpus": "corpora/full"}})
        assert created.status_code == 201, created.text
        task_id = created.json()["taskId"]

        def snapshot() -> dict[str, Any]:
            return client.get(f"/runtime/tasks/{task_id}").json()

        wait_until(
            lambda: snapshot()["infrastructureFaults"] >= 1 or snapshot()["runtimeStatus"] not in ACTIVE,
            timeout=90,
            what="the report's write to meet the full disk",
        )
        assert snapshot()["runtimeStatus"] in ACTIVE, snapshot()  # delayed, not failed
        assert not list((data / "blobs").rglob("report.json"))
        disk.free()
        wait_until(lambda: snapshot()["runtimeStatus"] not in ACTIVE, timeout=120, what="the review to end")
        final = snapshot()
        assert final["runtimeStatus"] == "completed", final
        assert final["infrastructureFaults"] >= 1 and final["recoveries"] == 0, final
        assert final["error"] is None, final
        assert client.get(f"/runtime/tasks/{task_id}/result").json()["result"]["documentsReviewed"] == 30
        assert list((data / "blobs").rglob("report.json"))
    finally:
        processes.stop_all()
        disk.unmount()
