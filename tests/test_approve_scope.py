"""The approve scope on both MCP wires (issue 16): an approval waits for a key with the
approve scope; a key of the same approver with only read or operate scope is refused
(403, nothing recorded), one with approve alone answers it. Against uvicorn; the task is
brought to its approval point by the engine in this process (no worker needed)."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest
from mcp.shared.exceptions import MCPError

from conftest import Processes, free_port, make_persona, wait_until
from mcp_server.shared import rpc_error
from steering_app.models import InputRequest, InputStatus, SteeringCommand
from tasks_app import engine
from tasks_app.access import console
from tasks_app.actions import do_create_task
from tasks_app.auth import issue_api_key
from tasks_app.errors import Forbidden
from tasks_app.models import Task
from tests import mcp_client as mc
from tests.mcp_stream import PostStream

pytestmark = pytest.mark.django_db(transaction=True)


def awaiting_approval(persona) -> tuple[Task, str]:
    """A task stopped before a guarded http.request, and its approval's key."""
    task, _ = do_create_task(
        console(persona.tenant, "user:creator"),
        agent="tool_calls",
        input={"calls": [{"tool": "http.request", "args": {"url": "http://127.0.0.1:9/x"}}]},
        approval_policy={"before": ["http.request"]},
    )
    engine.run_slice(task.id, worker_id="test")
    request = InputRequest.objects.get(task=task, status=InputStatus.OPEN)
    assert request.kind == "approval" and Task.objects.get(id=task.id).status == "input_required"
    return task, request.key


def refusal(key: str) -> Any:
    """What the one error table (tasks_app/errors.py) answers on MCP for an approval
    answered without the approve scope: the same on both wires as on REST."""
    return rpc_error(Forbidden(f"{key}: answering an approval needs the approver role"))


@pytest.fixture
def keys(db) -> dict[str, str]:
    """One approver's keys, each narrowed to one scope, and one that reads and approves
    (waiting on tasks/result is a read: it needs the read scope)."""
    april = make_persona("acme", "april", "approver")
    return {
        "+".join(scopes): issue_api_key(
            april.tenant, april.user, role="approver", name="+".join(scopes), scopes=scopes
        )[1]
        for scopes in (["read"], ["operate"], ["approve"], ["read", "approve"])
    }


@pytest.fixture
def live(processes: Processes) -> str:
    port = free_port()
    processes.web(port)
    return f"http://127.0.0.1:{port}/mcp"


def answers_of(task: Task) -> list[str]:
    return list(SteeringCommand.objects.filter(task=task, type="provide_input").values_list("requested_by", flat=True))


def test_tasks_update_answers_an_approval_only_with_the_approve_scope(live, keys, alice):
    task, key = awaiting_approval(alice)
    approve = {key: {"action": "accept", "content": {"answer": "approve"}}}

    async def update(token: str) -> Any:
        async with mc.client(live, token) as c:
            try:
                return await mc.update_task(c.session, str(task.id), approve)
            except MCPError as exc:
                return exc

    for scope in ("read", "operate"):
        refused = asyncio.run(update(keys[scope]))
        assert isinstance(refused, MCPError) and "approv" in refused.error.message, refused
        expected = refusal(key)
        assert (refused.error.code, refused.error.message, refused.error.data) == (
            expected.code,
            expected.message,
            None,
        )
        assert answers_of(task) == []
    assert not isinstance(asyncio.run(update(keys["approve"])), MCPError)
    assert len(answers_of(task)) == 1
    command = SteeringCommand.objects.get(task=task, type="provide_input")
    assert command.payload == {"key": key, "answer": "approve"}


def test_a_legacy_elicitation_answer_needs_the_approve_scope(live, keys, alice):
    task, key = awaiting_approval(alice)

    def post(token: str, body: dict[str, Any], session_id: str = "") -> httpx.Response:
        headers = {
            "Authorization": f"Bearer {token}",
            "Accept": "application/json, text/event-stream",
            "MCP-Protocol-Version": "2025-11-25",
            **({"Mcp-Session-Id": session_id} if session_id else {}),
        }
        return httpx.post(live, json=body, headers=headers, timeout=30)

    init = {
        "protocolVersion": "2025-11-25",
        "capabilities": {"elicitation": {}},
        "clientInfo": {"name": "raw", "version": "0"},
    }
    session_id = post(
        keys["read+approve"], {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": init}
    ).headers["Mcp-Session-Id"]
    stream = PostStream(
        live,
        {"jsonrpc": "2.0", "id": 3, "method": "tasks/result", "params": {"taskId": str(task.id)}},
        {
            "Authorization": f"Bearer {keys['read+approve']}",
            "Mcp-Session-Id": session_id,
            "Accept": "application/json, text/event-stream",
            "MCP-Protocol-Version": "2025-11-25",
        },
    )
    asked = wait_until(lambda: stream.first("elicitation/create"), timeout=30, what="the approval to be asked")
    accept = {"action": "accept", "content": {"answer": "approve"}}
    # The same approver's narrower keys carry the same actor, so the id reads back, but the scope does not suffice.
    for scope in ("read", "operate"):
        refused = post(keys[scope], {"jsonrpc": "2.0", "id": asked["id"], "result": accept})
        assert refused.status_code == refusal(key).http_status == 403, refused.content
        assert "approv" in refused.json()["error"]["message"]
        assert refused.json() == refusal(key).body(None)
    assert answers_of(task) == []
    answered = post(keys["approve"], {"jsonrpc": "2.0", "id": asked["id"], "result": accept}, session_id)
    assert answered.status_code == 202, answered.content
    assert len(answers_of(task)) == 1
    assert SteeringCommand.objects.get(task=task, type="provide_input").payload == {"key": key, "answer": "approve"}
