"""The 2025-11-25 surface for hosts that have not moved, driven by the official 1.x SDK
(mcp 1.30, its experimental task client) in its own virtual environment (.ci/mcp1-venv.sh)."""

from __future__ import annotations

import json
import subprocess
from typing import Any

import httpx
import pytest

from conftest import ROOT, Processes, free_port, wait_until
from steering_app.models import InputRequest, InputStatus, SteeringCommand
from tasks_app.models import Task
from tests.mcp_stream import PostStream

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(scope="module")
def mcp1_python() -> str:
    made = subprocess.run(
        [str(ROOT / ".ci" / "mcp1-venv.sh")], capture_output=True, text=True, check=False, timeout=600
    )
    assert made.returncode == 0, made.stderr
    return made.stdout.strip().splitlines()[-1]


def test_legacy_task_flow_with_the_1x_sdk(mcp1_python, alice, mallory, processes: Processes):
    port = free_port()
    processes.web(port)
    processes.worker(concurrency=2)
    other = Task.objects.create(tenant=mallory.tenant, created_by="user:0", agent="noop", input={"steps": 1})
    run = subprocess.run(
        [mcp1_python, str(ROOT / "tests" / "mcp1_legacy_client.py"), f"http://127.0.0.1:{port}/mcp", alice.token],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    seen = json.loads(run.stdout.strip().splitlines()[-1])
    assert seen["protocolVersion"] == "2025-11-25"
    assert seen["tasksCapability"] == {"list": {}, "cancel": {}, "requests": {"tools": {"call": {}}}}
    assert seen["taskSupport"]["slow_compute"] == "optional" and seen["taskSupport"]["greet"] == "forbidden"
    assert seen["taskSupport"]["confirm_delete"] == "required"
    assert seen["created"]["status"] == "working" and seen["created"]["ttl"] == 60000
    assert seen["statuses"][-1] == "completed"
    related = seen["result"]["_meta"]["io.modelcontextprotocol/related-task"]
    assert related == {"taskId": seen["created"]["taskId"]}
    assert seen["result"]["structuredContent"]["text"] == "computed for 1s (legacy)"
    # tasks/list: only the caller's own tasks, never another tenant's
    assert seen["created"]["taskId"] in seen["listed"] and str(other.id) not in seen["listed"]
    assert seen["cancelled"] == "cancelled"  # the worker stopped at its next safe point
    assert seen["cancelAgain"] == -32602  # 2025-11-25: cancelling a terminal task is an error
    assert Task.objects.get(id=seen["cancelId"]).status == "cancelled"
    assert seen["failingStatuses"][-1] == "failed"  # 2025-11-25: isError makes the task failed
    assert seen["unknown"] == -32602
    assert seen["greet"] == "Hello, legacy!"


def test_a_legacy_host_is_asked_on_the_tasks_result_stream(mcp1_python, alice, processes: Processes):
    """The 1.x SDK's elicitation_callback answers the questions the server sends as
    elicitation/create on the tasks/result stream; tasks/result then returns the result.
    A decline leaves the question open (as in tasks/update) and is not asked again."""
    port = free_port()
    processes.web(port)
    processes.worker(concurrency=2)
    run = subprocess.run(
        [mcp1_python, str(ROOT / "tests" / "mcp1_legacy_input.py"), f"http://127.0.0.1:{port}/mcp", alice.token],
        capture_output=True,
        text=True,
        check=False,
        timeout=180,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    seen = json.loads(run.stdout.strip().splitlines()[-1])

    confirm = seen["confirm"]
    assert confirm["sessionId"]  # minted at initialize: it carries the declared elicitation capability
    assert [a["message"] for a in confirm["asked"]] == ["Delete a.txt?"]
    assert confirm["asked"][0]["related"] == {"taskId": confirm["taskId"]}
    assert confirm["asked"][0]["schema"]["properties"]["confirm"]["type"] == "boolean"
    assert confirm["text"] == "deleted a.txt"
    assert confirm["meta"]["io.modelcontextprotocol/related-task"] == {"taskId": confirm["taskId"]}
    request = InputRequest.objects.get(task_id=confirm["taskId"], key="confirm")
    assert (request.status, request.answer, request.answered_by) == (
        InputStatus.ANSWERED,
        {"confirm": True},
        f"user:{alice.user.pk}",
    )
    assert Task.objects.get(id=confirm["taskId"]).status == "completed"

    multi = seen["multi"]  # ctx.ask_all(): both questions are asked on the one stream
    assert sorted(multi["asked"]) == ["First confirmation?", "Second confirmation?"]
    assert multi["text"] == "answers: first=True, second=False"

    declined = seen["decline"]
    assert declined["asked"] == 1  # not asked again on the same stream
    assert declined["statusAfterDecline"] == "input_required"
    assert declined["rest"] == 202  # the question was still open for someone else to answer
    assert declined["text"] == "deleted b.txt"
    commands = SteeringCommand.objects.filter(task_id=declined["taskId"], type="provide_input")
    assert [c.reason for c in commands] == [""]  # only REST's answer; the decline recorded nothing


def test_an_answer_posted_to_another_web_process_is_recorded_and_only_from_the_asked_principal(
    alice, mallory, processes: Processes
):
    """The stream is held by one uvicorn, the answer POSTed to another: nothing lives in a
    process's memory. The request id is bound to the principal that was asked."""
    holding, other = free_port(), free_port()
    processes.web(holding)
    processes.web(other)
    processes.worker()
    mcp = {port: f"http://127.0.0.1:{port}/mcp" for port in (holding, other)}

    def post(port: int, who, body: dict[str, Any], session_id: str = "") -> httpx.Response:
        headers = {
            "Authorization": f"Bearer {who.token}",
            "Accept": "application/json, text/event-stream",
            "MCP-Protocol-Version": "2025-11-25",
            **({"Mcp-Session-Id": session_id} if session_id else {}),
        }
        return httpx.post(mcp[port], json=body, headers=headers, timeout=30)

    init = post(
        holding,
        alice,
        {
            "jsonrpc": "2.0",
            "id": 1,
            "method": "initialize",
            "params": {
                "protocolVersion": "2025-11-25",
                "capabilities": {"elicitation": {}},
                "clientInfo": {"name": "raw", "version": "0"},
            },
        },
    )
    session_id = init.headers["Mcp-Session-Id"]
    created = post(
        holding,
        alice,
        {
            "jsonrpc": "2.0",
            "id": 2,
            "method": "tools/call",
            "params": {"name": "confirm_delete", "arguments": {"filename": "c.txt"}, "task": {"ttl": 60000}},
        },
        session_id,
    )
    task_id = created.json()["result"]["task"]["taskId"]
    stream = PostStream(
        mcp[holding],
        {"jsonrpc": "2.0", "id": 3, "method": "tasks/result", "params": {"taskId": task_id}},
        {
            "Authorization": f"Bearer {alice.token}",
            "Mcp-Session-Id": session_id,
            "Accept": "application/json, text/event-stream",
            "MCP-Protocol-Version": "2025-11-25",
        },
    )
    asked = wait_until(
        lambda: stream.first("elicitation/create"), timeout=30, what="elicitation/create on the tasks/result stream"
    )
    assert asked["params"]["_meta"] == {"io.modelcontextprotocol/related-task": {"taskId": task_id}}
    accept = {"action": "accept", "content": {"confirm": True}}

    # Another tenant's principal cannot answer, even with the exact id; nor can a forged id.
    assert post(other, mallory, {"jsonrpc": "2.0", "id": asked["id"], "result": accept}).status_code == 400
    forged = asked["id"][:-3] + ("aaa" if not asked["id"].endswith("aaa") else "bbb")
    assert post(other, alice, {"jsonrpc": "2.0", "id": forged, "result": accept}).status_code == 400
    assert InputRequest.objects.get(task_id=task_id, key="confirm").status == InputStatus.OPEN

    answered = post(other, alice, {"jsonrpc": "2.0", "id": asked["id"], "result": accept}, session_id)
    assert answered.status_code == 202, answered.content
    final = wait_until(stream.response, timeout=30, what="the tasks/result response")
    assert final["id"] == 3 and final["result"]["structuredContent"] == {"text": "deleted c.txt"}
    assert stream.methods() == ["elicitation/create"]


def test_a_client_that_did_not_declare_elicitation_is_never_asked(alice, mallory):
    from mcp_server import elicit
    from tasks_app.auth import Principal

    me = Principal(alice.tenant, alice.role, f"user:{alice.user.pk}")
    them = Principal(mallory.tenant, mallory.role, f"user:{mallory.user.pk}")
    assert elicit.asks_forms(me, elicit.mint_session(me, {"elicitation": {}}))
    assert elicit.asks_forms(me, elicit.mint_session(me, {"elicitation": {"form": {}, "url": {}}}))
    assert not elicit.asks_forms(me, elicit.mint_session(me, {"elicitation": {"url": {}}}))
    assert not elicit.asks_forms(me, elicit.mint_session(me, {}))
    assert not elicit.asks_forms(me, None)
    assert not elicit.asks_forms(them, elicit.mint_session(me, {"elicitation": {}}))  # bound to who was given it
