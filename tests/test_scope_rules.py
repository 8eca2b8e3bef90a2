"""One access rule per power, on every edge (issue 16): reading a task needs the read scope
on MCP as on REST and SSE; answering an approval needs the approve scope and answering an
agent's own question the operate scope, on REST's inputs, steering's provide_input and MCP
alike; a refused bearer is told why (RFC 6750 §3). In-process (the Django test client);
the tasks are brought to their questions by the engine in this process."""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import pytest
from django.test import Client
from django.utils import timezone

from conftest import make_persona
from mcp_server.protocol import MODERN, TASKS_EXT
from mcp_server.shared import rpc_error
from steering_app.models import InputRequest, InputStatus, SteeringCommand
from tasks_app import engine
from tasks_app.access import console
from tasks_app.actions import do_create_task
from tasks_app.auth import issue_api_key, revoke_api_key
from tasks_app.errors import Forbidden
from tasks_app.models import ApiKey, Task
from tests.test_approve_scope import awaiting_approval

pytestmark = pytest.mark.django_db(transaction=True)

LEGACY = "2025-11-25"
META = {
    "io.modelcontextprotocol/protocolVersion": MODERN,
    "io.modelcontextprotocol/clientCapabilities": {"extensions": {TASKS_EXT: {}}},
}


def scoped_keys(role: str, name: str, *scope_sets: list[str]) -> dict[str, str]:
    """One person's keys, each narrowed to a set of scopes, by their scopes joined with '+'."""
    who = make_persona("acme", name, role)
    return {
        "+".join(scopes): issue_api_key(who.tenant, who.user, role=role, name="+".join(scopes), scopes=scopes)[1]
        for scopes in scope_sets
    }


def rpc(token: str, method: str, params: dict[str, Any], *, wire: str = MODERN, request_id: Any = 11):
    headers = {"Accept": "application/json, text/event-stream", "MCP-Protocol-Version": wire}
    if wire == MODERN:
        headers["Mcp-Method"] = method
        if isinstance(params.get("taskId"), str):
            headers["Mcp-Name"] = params["taskId"]
        params = {"_meta": META, **params}
    headers["Authorization"] = f"Bearer {token}"
    body = {"jsonrpc": "2.0", "id": request_id, "method": method, "params": params}
    return Client().post("/mcp", data=json.dumps(body), content_type="application/json", headers=headers)


def asking_task(persona) -> tuple[Task, str]:
    """A task waiting on its agent's own question (not an approval)."""
    task, _ = do_create_task(console(persona.tenant, "user:creator"), agent="noop", input={"steps": 2, "askAt": 1})
    engine.run_slice(task.id, worker_id="test")
    request = InputRequest.objects.get(task=task, status=InputStatus.OPEN)
    assert request.kind == "question" and Task.objects.get(id=task.id).status == "input_required"
    return task, request.key


# --- 1. MCP reads need the read scope -----------------------------------------------------------


def test_mcp_reads_need_the_read_scope_on_both_wires_as_rest_does(alice):
    keys = scoped_keys("admin", "ada", ["operate", "approve"], ["read"])
    blind, reader = keys["operate+approve"], keys["read"]
    task, _ = do_create_task(console(alice.tenant, "user:creator"), agent="noop", input={"steps": 1})
    task_id = str(task.id)
    # REST and SSE refuse a key without read: the baseline MCP must match.
    assert Client(headers={"Authorization": f"Bearer {blind}"}).get(f"/runtime/tasks/{task_id}").status_code == 403
    # How MCP refuses a missing operate scope today (tasks/cancel): the error table's Forbidden, with the id.
    refused_cancel = rpc(reader, "tasks/cancel", {"taskId": task_id})
    assert refused_cancel.json()["error"]["code"] == rpc_error(Forbidden("x")).code
    assert refused_cancel.json()["id"] == 11

    reads = [
        (MODERN, "tasks/get", {"taskId": task_id}),
        (MODERN, "subscriptions/listen", {"notifications": {"taskIds": [task_id]}}),
        (LEGACY, "tasks/get", {"taskId": task_id}),
        (LEGACY, "tasks/result", {"taskId": task_id}),
        (LEGACY, "tasks/list", {}),
    ]
    for wire, method, params in reads:
        refused = rpc(blind, method, params, wire=wire, request_id=f"r-{method}")
        body = refused.json()
        assert "error" in body and body["id"] == f"r-{method}", (wire, method, refused.status_code, body)
        assert body["error"]["code"] == refused_cancel.json()["error"]["code"], (wire, method, body)
        assert "viewer" in body["error"]["message"], (wire, method, body)
        assert refused.status_code == (403 if wire == MODERN else 200), (wire, method)
        assert task_id not in refused.content.decode()
    # The read scope alone reads on both wires.
    assert rpc(reader, "tasks/get", {"taskId": task_id}).json()["result"]["taskId"] == task_id
    assert rpc(reader, "tasks/get", {"taskId": task_id}, wire=LEGACY).json()["result"]["taskId"] == task_id
    # And a key without read still acts: it cancels (operate) without reading.
    assert "result" in rpc(blind, "tasks/cancel", {"taskId": task_id}).json()


# --- 2. Answering: approve for approvals, operate for questions, on every edge ------------------


def test_an_approve_only_key_answers_an_approval_over_rest_inputs_and_steering(alice):
    keys = scoped_keys("approver", "april", ["approve"], ["operate", "read"])
    approver, operator = keys["approve"], keys["operate+read"]

    task, key = awaiting_approval(alice)
    refused = Client(headers={"Authorization": f"Bearer {operator}"}).post(
        f"/runtime/tasks/{task.id}/inputs/{key}", {"answer": "approve"}, content_type="application/json"
    )
    assert refused.status_code == 403 and "approv" in refused.json()["error"]["message"]
    answered = Client(headers={"Authorization": f"Bearer {approver}"}).post(
        f"/runtime/tasks/{task.id}/inputs/{key}", {"answer": "approve"}, content_type="application/json"
    )
    assert answered.status_code == 202, answered.content
    assert SteeringCommand.objects.get(task=task, type="provide_input").payload == {"key": key, "answer": "approve"}

    task, key = awaiting_approval(alice)
    version = Task.objects.get(id=task.id).state_version

    def steer(token: str, command_id: str):
        body = {
            "commandId": command_id,
            "type": "provide_input",
            "payload": {"key": key, "answer": "approve"},
            "expectedVersion": version,
        }
        return Client(headers={"Authorization": f"Bearer {token}"}).post(
            f"/runtime/tasks/{task.id}/steering", body, content_type="application/json"
        )

    refused = steer(operator, "by-operator")
    assert refused.status_code == 403 and "approv" in refused.json()["error"]["message"]
    answered = steer(approver, "by-approver")
    assert answered.status_code == 202, answered.content
    assert SteeringCommand.objects.get(task=task, type="provide_input").command_id == "by-approver"


def test_an_agents_own_question_needs_the_operate_scope_on_every_edge(alice):
    keys = scoped_keys("approver", "april", ["approve", "read"], ["operate"])
    approver, operator = keys["approve+read"], keys["operate"]

    task, key = asking_task(alice)
    for token, expected in ((approver, 403), (operator, 202)):
        response = Client(headers={"Authorization": f"Bearer {token}"}).post(
            f"/runtime/tasks/{task.id}/inputs/{key}", {"answer": True}, content_type="application/json"
        )
        assert response.status_code == expected, response.content
    task, key = asking_task(alice)
    refused = rpc(approver, "tasks/update", {"taskId": str(task.id), "inputResponses": {key: {"action": "accept"}}})
    assert refused.status_code == 403 and "operator" in refused.json()["error"]["message"]
    version = Task.objects.get(id=task.id).state_version
    refused = Client(headers={"Authorization": f"Bearer {approver}"}).post(
        f"/runtime/tasks/{task.id}/steering",
        {
            "commandId": "c1",
            "type": "provide_input",
            "payload": {"key": key, "answer": True},
            "expectedVersion": version,
        },
        content_type="application/json",
    )
    assert refused.status_code == 403
    assert not SteeringCommand.objects.filter(task=task).exists()


# --- 3. A refused bearer is told why (RFC 6750 §3) -----------------------------------------------


def test_a_rest_401_says_whether_the_credential_was_missing_or_invalid(alice):
    task, _ = do_create_task(console(alice.tenant, "user:creator"), agent="noop", input={"steps": 1})
    expired_key, expired = issue_api_key(
        alice.tenant, alice.user, role="operator", name="old", expires_at=timezone.now() + timedelta(seconds=1)
    )
    ApiKey.objects.filter(pk=expired_key.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
    revoked_key, revoked = issue_api_key(alice.tenant, alice.user, role="operator", name="gone")
    revoke_api_key(revoked_key)
    paths = ["/runtime/tasks", f"/runtime/tasks/{task.id}", f"/runtime/tasks/{task.id}/events"]

    for path in paths:
        missing = Client().get(path)
        assert missing.status_code == 401, (path, missing.content)
        challenge = missing.get("WWW-Authenticate", "")
        assert challenge.startswith("Bearer "), (path, challenge)
        assert "error=" not in challenge, (path, challenge)  # no credential: no error code (§3.1)
        assert 'resource_metadata="http://testserver/.well-known/oauth-protected-resource"' in challenge
        for what, token in (
            ("unknown", "rt_0123456789ab_" + "x" * 43),
            ("malformed", "not-a-key"),
            ("expired", expired),
            ("revoked", revoked),
        ):
            bad = Client(headers={"Authorization": f"Bearer {token}"}).get(path)
            assert bad.status_code == 401, (path, what, bad.content)
            challenge = bad.get("WWW-Authenticate", "")
            assert challenge.startswith("Bearer ") and 'error="invalid_token"' in challenge, (path, what, challenge)
            assert "resource_metadata=" in challenge
    # /mcp keeps its own (and says the same).
    assert 'error="invalid_token"' in rpc(revoked, "tasks/get", {"taskId": str(task.id)})["WWW-Authenticate"]
