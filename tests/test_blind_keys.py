"""A key without the read scope acts without reading (issue 16): what it is told when it acts
(a cancel's answer, a refused or conflicting command, a replayed command id) says whether
the act took and the version to act at, never the task (its goal, its error, its questions)
or another caller's command; and a narrow key cannot revoke a wider one of its user (a leaked
read-only exporter key must not switch off its user's operating keys). In-process (the
Django test client); the tasks are brought to their questions by the engine in this process."""

from __future__ import annotations

import json
from typing import Any

import pytest
from asgiref.sync import async_to_sync
from django.test import Client

from steering_app.models import InputRequest, InputStatus
from tasks_app import engine
from tasks_app.access import console
from tasks_app.actions import do_create_task
from tasks_app.models import ApiKey, Task
from tests.test_scope_rules import LEGACY, rpc, scoped_keys

pytestmark = pytest.mark.django_db(transaction=True)

GOAL = "merge the quarterly numbers of project larkspur"


def as_key(token: str) -> Client:
    return Client(headers={"Authorization": f"Bearer {token}"})


def steer(token: str, task: Task, command_id: str, expected_version: int, **fields: Any):
    body = {"commandId": command_id, "type": "pause", "payload": {}, "expectedVersion": expected_version, **fields}
    return as_key(token).post(f"/runtime/tasks/{task.id}/steering", body, content_type="application/json")


def test_a_key_without_read_learns_the_version_but_not_the_task_from_a_stale_command(alice):
    keys = scoped_keys("operator", "otto", ["operate"], ["operate", "read"])
    blind, sighted = keys["operate"], keys["operate+read"]
    task, _ = do_create_task(console(alice.tenant, "user:creator"), agent="noop", input={"steps": 2}, goal=GOAL)
    version = Task.objects.get(id=task.id).state_version

    stale = steer(blind, task, "blind-1", version + 7)
    assert stale.status_code == 409, stale.content
    # What it needs to act again: the version now. Not the task.
    assert stale.json()["error"]["currentVersion"] == version
    assert "snapshot" not in stale.json()["error"], stale.json()
    assert GOAL not in stale.content.decode()
    # A key that may read gets the snapshot, as before.
    seen = steer(sighted, task, "sighted-1", version + 7)
    assert seen.status_code == 409 and seen.json()["error"]["snapshot"]["goal"] == GOAL


def test_a_key_without_read_cancels_without_reading_the_task(alice):
    keys = scoped_keys("operator", "olga", ["operate"])
    task, _ = do_create_task(console(alice.tenant, "user:creator"), agent="noop", input={"steps": 2}, goal=GOAL)

    cancelled = as_key(keys["operate"]).post(f"/runtime/tasks/{task.id}/cancel", {}, content_type="application/json")
    assert cancelled.status_code == 202, cancelled.content
    body = cancelled.json()
    assert body["taskId"] == str(task.id) and body["runtimeStatus"] == "cancelled"
    assert GOAL not in cancelled.content.decode() and "goal" not in body
    # Refused for being finished: a 409 without the snapshot either.
    again = as_key(keys["operate"]).post(f"/runtime/tasks/{task.id}/cancel", {}, content_type="application/json")
    assert again.status_code == 409 and GOAL not in again.content.decode()


def test_a_command_id_replays_only_for_the_caller_that_sent_it(alice):
    keys = scoped_keys("approver", "paula", ["operate"])
    task, _ = do_create_task(console(alice.tenant, "user:creator"), agent="noop", input={"steps": 2, "askAt": 1})
    engine.run_slice(task.id, worker_id="test")
    request = InputRequest.objects.get(task=task, status=InputStatus.OPEN)
    version = Task.objects.get(id=task.id).state_version
    answered = as_key(alice.token).post(
        f"/runtime/tasks/{task.id}/steering",
        {
            "commandId": "alices-answer",
            "type": "provide_input",
            "payload": {"key": request.key, "answer": True},
            "expectedVersion": version,
            "reason": "the launch codes are 0000, from the runbook",
        },
        content_type="application/json",
    )
    assert answered.status_code == 202, answered.content

    # Another caller naming that command id is not its sender: no replay of alice's answer.
    other = steer(keys["operate"], task, "alices-answer", version)
    assert other.status_code == 409, other.content
    assert "launch codes" not in other.content.decode() and "runbook" not in other.content.decode()
    # Alice's own replay still gets her command back.
    replay = as_key(alice.token).post(
        f"/runtime/tasks/{task.id}/steering",
        {
            "commandId": "alices-answer",
            "type": "provide_input",
            "payload": {"key": request.key, "answer": True},
            "expectedVersion": version,
        },
        content_type="application/json",
    )
    assert replay.status_code == 202 and replay.json()["commandId"] == "alices-answer"


def test_a_narrow_key_cannot_revoke_a_wider_key_of_its_user(alice):
    keys = scoped_keys("operator", "rita", ["read"], ["operate", "read"])
    reader, full = keys["read"], keys["operate+read"]
    full_id = ApiKey.objects.get(user__username="rita", name="operate+read").prefix
    refused = as_key(reader).delete(f"/runtime/keys/{full_id}")
    assert refused.status_code == 403, refused.content
    assert ApiKey.objects.get(prefix=full_id).revoked_at is None
    assert as_key(full).get("/runtime/tasks").status_code == 200
    # The wider key revokes the narrower one, and a key may always revoke itself.
    reader_id = ApiKey.objects.filter(user__username="rita", name="read").first().prefix
    assert as_key(reader).delete(f"/runtime/keys/{reader_id}").status_code == 200
    assert as_key(full).delete(f"/runtime/keys/{full_id}").status_code == 200


def final_message(response) -> dict[str, Any]:
    """The JSON-RPC answer of a /mcp response, plain JSON or the last message of its stream."""
    if response["Content-Type"].startswith("application/json"):
        return response.json()

    async def chunks() -> bytes:
        return b"".join([chunk async for chunk in response.streaming_content])

    body = async_to_sync(chunks)().decode()
    return [json.loads(line[6:]) for line in body.splitlines() if line.startswith("data: ")][-1]


def test_a_key_without_read_cancels_over_legacy_mcp_without_reading_the_task(alice):
    """The 2025 wire answers tasks/cancel with the Task: its status, not its message (why it
    ended; before it, the agent's question or an error) for a key that may not read it."""
    keys = scoped_keys("operator", "otis", ["operate"], ["operate", "read"])
    for token, shown in ((keys["operate"], False), (keys["operate+read"], True)):
        task, _ = do_create_task(console(alice.tenant, "user:creator"), agent="noop", input={"steps": 2, "askAt": 1})
        engine.run_slice(task.id, worker_id="test")
        prompt = InputRequest.objects.get(task=task, status=InputStatus.OPEN).prompt
        assert prompt in Task.objects.get(id=task.id).status_text()
        answer = final_message(rpc(token, "tasks/cancel", {"taskId": str(task.id)}, wire=LEGACY))
        assert answer["result"]["taskId"] == str(task.id) and answer["result"]["status"] == "cancelled", answer
        assert prompt not in json.dumps(answer)  # what the task said before it was cancelled
        assert ("statusMessage" in answer["result"]) is shown, answer
        if shown:
            assert answer["result"]["statusMessage"] == "cancelled over MCP tasks/cancel"
