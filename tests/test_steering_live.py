"""Steering over real HTTP (uvicorn) against tasks run by real Celery workers."""

from __future__ import annotations

import json
import random
import threading
import time
from datetime import datetime

import httpx
import pytest

from checkpoints_app.models import Checkpoint
from conftest import FAST_LEASES, Processes, free_port, wait_until
from runtime_site.blobstore import blob_store
from steering_app.models import SteeringCommand
from tasks_app.agents.document_review.corpus import generate_corpus
from tasks_app.audit import verify_chain
from tasks_app.models import AuditRecord, Step, Task

pytestmark = pytest.mark.django_db(transaction=True)

FAST = {**FAST_LEASES, "RUNTIME_SLICE_STEPS": "8"}


class Api:
    def __init__(self, base: str, token: str) -> None:
        self.base, self.token = base, token
        self.http = self.client()

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.base, headers={"Authorization": f"Bearer {self.token}"}, timeout=30)

    def create(self, agent: str, input: dict, **extra) -> str:
        response = self.http.post("/runtime/tasks", json={"agent": agent, "input": input, **extra})
        assert response.status_code == 201, response.text
        return response.json()["taskId"]

    def snapshot(self, task_id: str) -> dict:
        return self.http.get(f"/runtime/tasks/{task_id}").json()

    def steer(
        self,
        task_id: str,
        type: str,
        payload: dict | None = None,
        *,
        version: int | None = None,
        command_id: str | None = None,
        http: httpx.Client | None = None,
        reason: str = "",
    ) -> httpx.Response:
        if version is None:
            version = self.snapshot(task_id)["stateVersion"]
        body = {
            "commandId": command_id or f"{type}-{random.getrandbits(48):x}",
            "type": type,
            "payload": payload or {},
            "expectedVersion": version,
            "reason": reason,
        }
        return (http or self.http).post(f"/runtime/tasks/{task_id}/steering", json=body)


@pytest.fixture
def live(alice, processes: Processes):
    port = free_port()
    processes.web(port)
    worker = processes.worker(concurrency=2, **FAST)
    processes.beat(**FAST)
    return Api(f"http://127.0.0.1:{port}", alice.token), worker


def steps_done(task_id: str) -> int:
    return Task.objects.values_list("steps_done", flat=True).get(id=task_id)


def status(task_id: str) -> str:
    return Task.objects.values_list("status", flat=True).get(id=task_id)


def test_two_clients_with_the_same_expected_version_exactly_one_wins_every_time(live):
    api, _ = live
    task_id = api.create("noop", {"steps": 5000, "sleepMs": 20})
    wait_until(lambda: steps_done(task_id) > 0, timeout=30, what="the task to run")
    clients = [api.client(), api.client()]
    for round_ in range(25):
        version = api.snapshot(task_id)["stateVersion"]
        barrier, codes = threading.Barrier(2), []

        def send(
            i: int,
            version: int = version,
            round_: int = round_,
            barrier: threading.Barrier = barrier,
            codes: list[int] = codes,
        ) -> None:
            barrier.wait()
            codes.append(
                api.steer(
                    task_id,
                    "set_priority",
                    {"priority": i + 3},
                    version=version,
                    command_id=f"r{round_}-c{i}",
                    http=clients[i],
                ).status_code
            )

        threads = [threading.Thread(target=send, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(codes) == [202, 409], (round_, codes)
    assert SteeringCommand.objects.filter(task_id=task_id).count() == 25
    api.steer(task_id, "cancel")


def test_a_storm_of_commands_ends_in_the_state_of_the_accepted_ones_in_accepted_order(live):
    api, _ = live
    task_id = api.create("noop", {"steps": 5000, "sleepMs": 10})
    wait_until(lambda: steps_done(task_id) > 0, timeout=30, what="the task to run")
    accepted, lock = [], threading.Lock()

    def operator(n: int) -> None:
        client, rng = api.client(), random.Random(n)
        for i in range(12):
            version = client.get(f"/runtime/tasks/{task_id}").json()["stateVersion"]
            if rng.random() < 0.5:
                type, payload = "set_priority", {"priority": rng.randrange(10)}
            else:
                type, payload = "adjust_goal", {"goal": f"goal from operator {n}, attempt {i}"}
            response = api.steer(task_id, type, payload, version=version, command_id=f"o{n}-{i}", http=client)
            assert response.status_code in (202, 409), response.text
            if response.status_code == 202:
                with lock:
                    accepted.append(response.json())

    threads = [threading.Thread(target=operator, args=(n,)) for n in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wait_until(
        lambda: not SteeringCommand.objects.filter(task_id=task_id, status="pending").exists(),
        timeout=30,
        what="every accepted command to be applied",
    )
    accepted.sort(key=lambda c: c["version"])
    assert len({c["version"] for c in accepted}) == len(accepted) >= 6
    listed = api.http.get(f"/runtime/tasks/{task_id}/steering").json()["results"]
    assert [c["commandId"] for c in listed] == [c["commandId"] for c in accepted]
    assert {c["status"] for c in listed} == {"applied"}
    expected_priority, expected_goal = 5, ""
    for command in accepted:  # fold them in accepted order
        if command["type"] == "set_priority":
            expected_priority = command["payload"]["priority"]
        else:
            expected_goal = command["payload"]["goal"]
    task = Task.objects.get(id=task_id)
    assert task.priority == expected_priority and task.goal == expected_goal
    assert task.plan_version == 1 + sum(1 for c in accepted if c["type"] == "adjust_goal")
    api.steer(task_id, "cancel")


def test_pause_stops_new_steps_checkpoints_and_resume_continues_from_it(live):
    api, _ = live
    task_id = api.create("noop", {"steps": 40, "sleepMs": 100}, checkpointPolicy={"everySteps": 5})
    wait_until(lambda: steps_done(task_id) >= 5, timeout=30, what="5 steps")
    response = api.steer(task_id, "pause", reason="look at the numbers")
    assert response.status_code == 202 and response.json()["status"] == "pending"
    wait_until(lambda: status(task_id) == "paused", timeout=30, what="the pause to land")
    command = SteeringCommand.objects.get(command_id=response.json()["commandId"])
    paused_at = steps_done(task_id)
    assert not Step.objects.filter(task_id=task_id, started_at__gt=command.applied_at).exists()
    checkpoint = Checkpoint.objects.filter(task_id=task_id).order_by("-id").first()
    assert (checkpoint.reason, checkpoint.sequence, checkpoint.steering_cursor) == ("pause", paused_at, command.version)
    # Watch it stay still for a while: a paused task takes no step.
    deadline = time.monotonic() + 1.5
    while time.monotonic() < deadline:
        assert steps_done(task_id) == paused_at
        time.sleep(0.1)
    assert api.steer(task_id, "resume").status_code == 202
    wait_until(lambda: status(task_id) == "completed", timeout=60, what="completion after resume")
    steps = list(Step.objects.filter(task_id=task_id).order_by("started_at").values_list("sequence", "attempt"))
    assert [s for s, _ in steps] == list(range(1, 41)) and {a for _, a in steps} == {1}
    assert verify_chain(Task.objects.get(id=task_id)) is None


def test_cancel_during_a_long_step_lets_the_step_finish_then_cancels(live):
    api, _ = live
    task_id = api.create("noop", {"steps": 5, "sleepMs": 2500})
    wait_until(lambda: steps_done(task_id) >= 1, timeout=30, what="the first step")
    sent = datetime.now().astimezone()
    response = api.steer(task_id, "cancel", reason="budget cut")  # a 2.5 s step is (about to be) under way
    assert response.status_code == 202 and response.json()["status"] == "pending"
    wait_until(lambda: status(task_id) == "cancelled", timeout=30, what="the cancel to land")
    command = SteeringCommand.objects.get(command_id=response.json()["commandId"])
    last = Step.objects.filter(task_id=task_id).order_by("-sequence").first()
    assert last.finished_at > sent  # the step in flight was not cut short ...
    assert command.applied_at >= last.finished_at  # ... the cancel landed after it committed ...
    assert not Step.objects.filter(task_id=task_id, started_at__gt=command.applied_at).exists()  # ... and nothing after
    assert last.sequence < 5
    task = Task.objects.get(id=task_id)
    assert task.cancel_reason == "budget cut" and api.snapshot(task_id)["status"] == "cancelled"


def test_adjust_goal_changes_what_the_review_does_next(live):
    api, _ = live
    store = blob_store()
    generate_corpus(store, "corpora/live-adjust", 200, 9, "2026-11-01")
    truth = json.loads(store.get("corpora/live-adjust/truth.json"))
    task_id = api.create(
        "document_review",
        {"corpus": "corpora/live-adjust", "batchSize": 10, "pacingMs": 250},
        goal="find risky contracts",
    )
    wait_until(lambda: steps_done(task_id) >= 4, timeout=30, what="a few batches")
    response = api.steer(
        task_id,
        "adjust_goal",
        {
            "goal": "prioritise compliance risk, exclude expired contracts",
            "constraints": {"excludeExpired": True, "focus": ["missing_data_protection"]},
        },
    )
    assert response.status_code == 202, response.text
    wait_until(lambda: status(task_id) == "completed", timeout=60, what="the review to finish")
    replanned = Checkpoint.objects.get(task_id=task_id, reason="steering")
    cursor = replanned.state["cursor"]  # documents reviewed under the old goal
    assert 0 < cursor < 200 and replanned.plan_version == 2
    expired_after = sum(
        1 for i, (_, doc) in enumerate(sorted(truth["documents"].items())) if i >= cursor and doc["expired"]
    )
    result = Task.objects.get(id=task_id).result
    assert expired_after > 0
    assert result["documentsReviewed"] == 200 - expired_after and result["skipped"] == expired_after


def test_a_command_accepted_just_before_a_worker_dies_is_applied_exactly_once(alice, processes: Processes):
    port = free_port()
    processes.web(port)
    doomed = processes.worker(**FAST)
    processes.beat(**FAST)
    api = Api(f"http://127.0.0.1:{port}", alice.token)
    task_id = api.create("noop", {"steps": 30, "sleepMs": 300})
    wait_until(lambda: steps_done(task_id) >= 3, timeout=30, what="3 steps")
    response = api.steer(task_id, "pause", command_id="pause-before-crash")
    assert response.json()["status"] == "pending"
    processes.kill(doomed)  # mid-step, before its safe point
    processes.worker(**FAST)
    wait_until(lambda: status(task_id) == "paused", timeout=60, what="recovery to apply the pause")
    task = Task.objects.get(id=task_id)
    assert task.recoveries == 1
    applied = AuditRecord.objects.filter(task=task, action="steering_applied", data__commandId="pause-before-crash")
    assert applied.count() == 1
    assert task.events.filter(type="steering.applied").count() == 1
    cp = Checkpoint.objects.filter(task=task).order_by("-id").first()
    assert cp.reason == "pause" and cp.steering_cursor == response.json()["version"]
    assert api.steer(task_id, "resume").status_code == 202
    wait_until(lambda: status(task_id) == "completed", timeout=60, what="completion")
    assert AuditRecord.objects.filter(task=task, action="steering_applied").count() == 2  # pause, resume
