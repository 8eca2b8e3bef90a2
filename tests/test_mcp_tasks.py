"""The /mcp server, modern wire (2026-07-28 + io.modelcontextprotocol/tasks), driven by the
official SDK client (mcp 2.x) against uvicorn and a real Celery worker."""

from __future__ import annotations

import asyncio
import uuid
from itertools import pairwise

import httpx
import jsonschema
import psycopg
import pytest
from asgiref.sync import sync_to_async
from django.db import connection, transaction
from django.db.models import F
from django.http import HttpRequest
from django.utils import timezone
from mcp.shared.exceptions import MCPError

from conftest import Processes, database_url, free_port, wait_until
from steering_app.models import InputRequest, InputStatus
from tasks_app.access import console
from tasks_app.actions import do_create_task
from tasks_app.agents import get_agent
from tasks_app.models import Task
from tests import mcp_client as mc
from tests.mcp_stream import PostStream

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def live(processes: Processes) -> str:
    port = free_port()
    processes.web(port)
    # Ready before the first call: a synchronous call waits 8 s for its run (docs/mcp.md), and
    # on a busy machine a worker still booting took longer than that to take the first slice.
    processes.worker(concurrency=2, ready=True)
    return f"http://127.0.0.1:{port}/mcp"


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=120))


def confirm(key: str, request: dict) -> dict:
    assert request["method"] == "elicitation/create"
    assert request["params"]["requestedSchema"]["type"] == "object"
    return {"action": "accept", "content": {"confirm": True}}


def test_sdk_task_round_trip_create_poll_input_update_complete(live, alice):
    async def scenario():
        async with mc.client(live, alice.token) as c:
            assert c.session is not None
            tools = {t.name: t for t in (await c.list_tools()).tools}
            assert {"noop", "greet", "slow_compute", "confirm_delete", "pause_task"} <= set(tools)
            created = await c.session.call_tool("confirm_delete", {"filename": "a.txt"}, allow_claimed=True)
            assert isinstance(created, mc.CreateTaskResult) and created.ttl_ms and created.ttl_ms > 0
            seen: list[dict] = []
            final = await mc.poll(c.session, created.task_id, answer=confirm, seen=seen)
            # the answer came by tasks/update, to a key the server chose, asked once
            asked = [t for t in seen if t["status"] == "input_required"]
            assert asked and list(asked[0]["inputRequests"]) == ["confirm"]
            assert final["status"] == "completed", final
            assert final["result"]["resultType"] == "complete"
            assert final["result"]["content"][0]["text"] == "deleted a.txt"
            jsonschema.validate(final["result"]["structuredContent"], tools["confirm_delete"].output_schema)
            # transparent: the helper claims the task, polls and unwraps; the SDK itself checks
            # structuredContent against the tool's outputSchema
            result = await c.call_tool("slow_compute", {"seconds": 0.5, "label": "x"})
            assert not result.is_error and result.structured_content["steps"] == 2
            return created.task_id

    task_id = run(scenario())
    task = Task.objects.get(id=task_id)  # the same row the REST API shows
    assert task.status == "completed" and task.tenant == alice.tenant and task.agent == "confirm_delete"
    assert uuid.UUID(task_id).version == 4


def test_sdk_multi_input_partial_update_keeps_the_task_waiting(live, alice):
    async def scenario():
        async with mc.client(live, alice.token) as c:
            created = await c.session.call_tool("multi_input", {}, allow_claimed=True)
            tid = created.task_id
            task = await wait_status(c.session, tid, "input_required")
            assert set(task["inputRequests"]) == {"first", "second"}
            await mc.update_task(
                c.session,
                tid,
                {
                    "first": {"action": "accept", "content": {"confirm": True}},
                    "nope": {"action": "accept", "content": {}},
                },
            )
            task = await wait_for(c.session, tid, lambda t: set(t.get("inputRequests", {})) == {"second"})
            assert task["status"] == "input_required"
            await mc.update_task(c.session, tid, {"second": {"action": "accept", "content": {"confirm": False}}})
            final = await mc.poll(c.session, tid)
            assert final["status"] == "completed"
            assert final["result"]["content"][0]["text"] == "answers: first=True, second=False"

    run(scenario())


def test_sdk_cancel_a_running_task_and_failures(live, alice):
    async def scenario():
        async with mc.client(live, alice.token) as c:
            created = await c.session.call_tool("slow_compute", {"seconds": 60}, allow_claimed=True)
            await wait_for(c.session, created.task_id, lambda t: "%" in t.get("statusMessage", ""))
            ack = await mc.cancel_task(c.session, created.task_id)
            assert ack.result_type == "complete"
            final = await mc.poll(c.session, created.task_id, timeout=15)
            assert final["status"] == "cancelled"
            again = await mc.cancel_task(c.session, created.task_id)  # terminal: same ack, no error
            assert again.result_type == "complete"
            # a tool error completes with isError; a protocol error fails with a JSON-RPC error
            tool_error = await c.session.call_tool("failing_job", {}, allow_claimed=True)
            done = await mc.poll(c.session, tool_error.task_id)
            assert done["status"] == "completed" and done["result"]["isError"] is True
            broken = await c.session.call_tool("protocol_error_job", {}, allow_claimed=True)
            failed = await mc.poll(c.session, broken.task_id)
            assert failed["status"] == "failed" and "result" not in failed
            assert failed["error"]["code"] == -32603 and "exploded" in failed["error"]["message"]
            return created.task_id

    task_id = run(scenario())
    assert Task.objects.get(id=task_id).status == "cancelled"


def test_unknown_and_foreign_task_ids_are_not_found(live, alice, mallory):
    async def scenario():
        async with mc.client(live, alice.token) as c:
            created = await c.session.call_tool("slow_compute", {"seconds": 0.25}, allow_claimed=True)
            for bad in (str(uuid.uuid4()), "not-a-uuid"):
                with pytest.raises(MCPError) as caught:
                    await mc.get_task(c.session, bad)
                assert caught.value.error.code == -32602
        async with mc.client(live, mallory.token) as other:
            for call in (mc.get_task, mc.cancel_task):
                with pytest.raises(MCPError) as caught:
                    await call(other.session, created.task_id)
                assert caught.value.error.code == -32602
            with pytest.raises(MCPError) as caught:
                await mc.update_task(other.session, created.task_id, {})
            assert caught.value.error.code == -32602

    run(scenario())


def test_without_the_extension_sync_tools_answer_and_task_tools_need_it(live, alice):
    async def scenario():
        async with mc.client(live, alice.token, tasks=False) as c:
            greeting = await c.call_tool("greet", {"name": "sep-2243"})
            assert greeting.content[0].text == "Hello, sep-2243!" and not greeting.is_error
            quick = await c.call_tool("slow_compute", {"seconds": 0})
            assert not quick.is_error and quick.structured_content["steps"] == 0
            with pytest.raises(MCPError) as caught:
                await c.call_tool("failing_job", {})
            assert caught.value.error.code == -32021
            assert caught.value.error.data["requiredCapabilities"] == {"extensions": {mc.TASKS: {}}}
            with pytest.raises(MCPError) as caught:
                await mc.get_task(c.session, str(uuid.uuid4()))
            assert caught.value.error.code == -32021

    run(scenario())
    # greet ran as a real agent on the engine: a completed Task row
    assert Task.objects.filter(agent="greet", status="completed").count() == 1


def test_steering_tools_go_through_do_enqueue_command(live, alice):
    async def scenario():
        async with mc.client(live, alice.token) as c:
            created = await c.session.call_tool("slow_compute", {"seconds": 60}, allow_claimed=True)
            tid = created.task_id
            await wait_for(c.session, tid, lambda t: "%" in t.get("statusMessage", ""))
            version = await state_version(tid)
            paused = await c.call_tool("pause_task", {"taskId": tid, "expectedVersion": version, "reason": "lunch"})
            assert not paused.is_error, paused
            assert paused.structured_content["type"] == "pause"
            stale = await c.call_tool("set_priority", {"taskId": tid, "expectedVersion": version, "priority": 1})
            assert stale.is_error and "version conflict" in stale.content[0].text
            await wait_for(c.session, tid, lambda t: "paused" in t.get("statusMessage", ""), timeout=15)
            version = await state_version(tid)
            cancelled = await c.call_tool(
                "cancel_task", {"taskId": tid, "expectedVersion": version, "reason": "not needed"}
            )
            assert not cancelled.is_error, cancelled
            final = await mc.poll(c.session, tid, timeout=15)
            assert final["status"] == "cancelled"
            return tid

    tid = run(scenario())
    task = Task.objects.get(id=tid)
    assert task.cancel_reason == "not needed"
    assert list(task.steering_commands.order_by("version").values_list("type", "status")) == [
        ("pause", "applied"),
        ("cancel", "applied"),
    ]


def test_the_kill_tool_stops_a_running_task_at_once_and_answers_with_the_kill_policy(live, alice):
    async def scenario():
        async with mc.client(live, alice.token) as c:
            created = await c.session.call_tool("slow_compute", {"seconds": 60}, allow_claimed=True)
            tid = created.task_id
            await wait_for(c.session, tid, lambda t: "%" in t.get("statusMessage", ""))
            version = await state_version(tid)
            with pytest.raises(MCPError) as no_reason:  # the tool's inputSchema requires it
                await c.call_tool("kill_task", {"taskId": tid, "expectedVersion": version})
            assert no_reason.value.error.code == -32602 and "'reason'" in no_reason.value.error.message
            blank = await c.call_tool("kill_task", {"taskId": tid, "expectedVersion": version, "reason": " "})
            assert blank.is_error and "reason" in blank.content[0].text  # the schema's to take, the domain's to refuse
            killed = await c.call_tool("kill_task", {"taskId": tid, "expectedVersion": version, "reason": "runaway"})
            assert not killed.is_error, killed
            assert killed.structured_content["runtimeStatus"] == "cancelled"  # not at the next safe point
            assert "payment.create" in killed.structured_content["killPolicy"]["finishFirst"]
            final = await mc.get_task(c.session, tid)
            assert final["status"] == "cancelled" and final["statusMessage"] == "killed: runaway"
            return tid

    task = Task.objects.get(id=run(scenario()))
    assert list(task.steering_commands.values_list("type", "status")) == [("kill", "applied")]


@pytest.fixture
def web_only(processes: Processes) -> str:
    """/mcp without a worker: for what is answered before any task runs."""
    port = free_port()
    processes.web(port)
    return f"http://127.0.0.1:{port}/mcp"


def test_steering_tool_arguments_are_held_to_the_tools_own_input_schema(web_only, alice):
    """Wrong types, a missing required field, a field the schema does not name: -32602 naming
    it, as the tool's inputSchema promises, and nothing reaches the task. An id whose shape
    only the domain refuses (a trailing newline: JSON Schema's "$" lets it through) is the
    domain's tool error, never stored as something else."""
    task, _ = do_create_task(console(alice.tenant, "user:x"), agent="noop", input={"steps": 3})
    tid = str(task.id)
    bad = [
        ("set_priority", {"taskId": tid, "expectedVersion": "1", "priority": 1}, "expectedVersion"),
        ("set_priority", {"taskId": tid, "expectedVersion": 1}, "'priority' is a required property"),
        ("set_priority", {"taskId": tid, "expectedVersion": 1, "priority": 12}, "priority"),
        ("pause_task", {"taskId": tid, "expectedVersion": 1, "force": True}, "'force' was unexpected"),
        ("pause_task", {"taskId": 5, "expectedVersion": 1}, "taskId"),
        ("pause_task", {"taskId": tid, "expectedVersion": True}, "expectedVersion"),
        ("pause_task", {"taskId": tid, "expectedVersion": 1, "commandId": {"a": 1}}, "commandId"),
        ("pause_task", {"taskId": tid, "expectedVersion": 1, "commandId": "a b"}, "commandId"),
        ("pause_task", {"taskId": tid, "expectedVersion": 1, "commandId": "x" * 65}, "commandId"),
        ("pause_task", {"taskId": tid, "expectedVersion": 1, "reason": None}, "reason"),
        ("adjust_goal", {"taskId": tid, "expectedVersion": 1, "goal": 5}, "goal"),
        ("cancel_task", {"expectedVersion": 1}, "'taskId' is a required property"),
    ]

    async def scenario():
        async with mc.client(web_only, alice.token) as c:
            for name, arguments, named in bad:
                with pytest.raises(MCPError) as caught:
                    await c.call_tool(name, arguments)
                assert caught.value.error.code == -32602, (name, arguments, caught.value.error)
                assert named in caught.value.error.message, (name, arguments, caught.value.error.message)
            newline = await c.call_tool("pause_task", {"taskId": tid, "expectedVersion": 1, "commandId": "p1\n"})
            assert newline.is_error and "commandId" in newline.content[0].text, newline

    run(scenario())
    task.refresh_from_db()
    assert (task.state_version, task.steering_commands.count()) == (1, 0)


@sync_to_async
def state_version(task_id: str) -> int:
    try:
        return Task.objects.values_list("state_version", flat=True).get(id=task_id)
    finally:
        connection.close()  # this ran on a helper thread: never leave its connection open


async def wait_for(session, task_id: str, predicate, timeout: float = 20) -> dict:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        task = await mc.get_task(session, task_id)
        if predicate(task):
            return task
        if loop.time() > deadline:
            raise AssertionError(f"timed out; last seen {task}")
        await asyncio.sleep(0.1)


async def wait_status(session, task_id: str, status: str) -> dict:
    return await wait_for(session, task_id, lambda t: t["status"] == status)


def test_fixture_agents_are_registered_with_valid_schemas():
    for name in (
        "greet",
        "slow_compute",
        "failing_job",
        "protocol_error_job",
        "confirm_delete",
        "multi_input",
        "test_tool_with_task",
        "test_missing_capability",
        "test_streaming_elicitation",
        "test_logging_tool",
    ):
        agent = get_agent(name)
        jsonschema.Draft202012Validator.check_schema(agent.output_schema)


def rpc(url: str, token: str, method: str, params: dict, name: str | None = None) -> dict:
    """One JSON-RPC request over plain httpx, answered with a JSON result."""
    answer = httpx.post(
        url, json=modern_body(1, method, params), headers=modern_headers(token, method, name), timeout=30
    )
    assert answer.status_code == 200, answer.content
    return answer.json()["result"]


def modern_headers(token: str, method: str, name: str | None = None) -> dict[str, str]:
    return {
        "Authorization": f"Bearer {token}",
        "Accept": "application/json, text/event-stream",
        "MCP-Protocol-Version": "2026-07-28",
        "Mcp-Method": method,
        **({"Mcp-Name": name} if name else {}),
    }


def modern_body(request_id: int, method: str, params: dict, *, tasks: bool = True) -> dict:
    caps = {"extensions": {mc.TASKS: {}}} if tasks else {}
    meta = {"io.modelcontextprotocol/protocolVersion": "2026-07-28", "io.modelcontextprotocol/clientCapabilities": caps}
    return {"jsonrpc": "2.0", "id": request_id, "method": method, "params": {**params, "_meta": meta}}


def test_listen_pushes_each_status_change_of_the_callers_tasks(live, alice, mallory):
    """subscriptions/listen with notifications.taskIds (raw httpx: the SDK's listen() has no
    taskIds): the ack names the accepted tasks, then notifications/tasks carries the full
    DetailedTask on each change, until every subscribed task is terminal."""

    def call(method: str, params: dict, name: str | None = None) -> dict:
        return rpc(live, alice.token, method, params, name)

    task_id = call("tools/call", {"name": "confirm_delete", "arguments": {"filename": "l.txt"}}, "confirm_delete")[
        "taskId"
    ]
    theirs = Task.objects.create(tenant=mallory.tenant, created_by="user:0", agent="noop", input={"steps": 1})
    stream = PostStream(
        live,
        modern_body(
            41,
            "subscriptions/listen",
            {"notifications": {"taskIds": [task_id, str(theirs.id), "not-a-task"], "toolsListChanged": True}},
        ),
        modern_headers(alice.token, "subscriptions/listen"),
    )
    wait_until(lambda: stream.messages, timeout=20, what="the listen acknowledgement")
    ack = stream.messages[0]
    assert ack["method"] == "notifications/subscriptions/acknowledged"
    assert ack["params"] == {
        "notifications": {"taskIds": [task_id]},  # never another tenant's task
        "_meta": {"io.modelcontextprotocol/subscriptionId": 41},
    }

    def pushed() -> list[dict]:
        return [m["params"] for m in stream.messages if m.get("method") == "notifications/tasks"]

    asking = wait_until(
        lambda: next((t for t in pushed() if t["status"] == "input_required"), None),
        timeout=30,
        what="a notifications/tasks with input_required",
    )
    key = next(iter(asking["inputRequests"]))
    assert asking["inputRequests"][key]["method"] == "elicitation/create"
    assert asking["_meta"] == {"io.modelcontextprotocol/subscriptionId": 41}
    call(
        "tasks/update",
        {"taskId": task_id, "inputResponses": {key: {"action": "accept", "content": {"confirm": True}}}},
        task_id,
    )
    wait_until(lambda: stream.closed, timeout=30, what="the listen stream to end once the task is terminal")
    statuses = [t["status"] for t in pushed()]
    assert statuses[-1] == "completed" and "input_required" in statuses
    assert all(t["taskId"] == task_id for t in pushed())
    assert all(a != b for a, b in pairwise(statuses))  # one notification per change
    done = pushed()[-1]
    assert done["result"]["structuredContent"] == {"text": "deleted l.txt"}
    final = stream.messages[-1]
    assert final["id"] == 41 and final["result"]["resultType"] == "complete"
    assert final["result"]["_meta"]["io.modelcontextprotocol/subscriptionId"] == 41
    assert set(stream.methods()) == {"notifications/subscriptions/acknowledged", "notifications/tasks"}


def test_listen_reads_a_task_and_its_open_questions_at_one_moment(live, alice):
    """A listen's look read the task rows, then each input_required task's open questions,
    each query seeing what was committed when it started: an answer committing between the
    two (the question answered and the task working, in one transaction) showed the task
    input_required with no question, pushed as one more input_required change (what the
    listen test above met once on a loaded machine). Made to happen every time: another
    session holds the questions' table until the look, its task rows read, waits for it,
    and commits the answer there."""
    task_id = rpc(
        live,
        alice.token,
        "tools/call",
        {"name": "confirm_delete", "arguments": {"filename": "m.txt"}},
        "confirm_delete",
    )["taskId"]
    stream = PostStream(
        live,
        modern_body(42, "subscriptions/listen", {"notifications": {"taskIds": [task_id]}}),
        modern_headers(alice.token, "subscriptions/listen"),
    )

    def pushed() -> list[dict]:
        return [m["params"] for m in stream.messages if m.get("method") == "notifications/tasks"]

    wait_until(lambda: any(t["status"] == "input_required" for t in pushed()), timeout=30, what="the question pushed")
    questions = InputRequest._meta.db_table
    with transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute(f"LOCK TABLE {questions} IN ACCESS EXCLUSIVE MODE")  # until the commit below
        wait_until(
            lambda: waiting_to_read(questions), timeout=30, what="the listen's next look to wait for the questions"
        )
        # What do_answer_input commits for a task no worker holds (steering's apply_command).
        InputRequest.objects.filter(task_id=task_id, key="confirm").update(
            status=InputStatus.ANSWERED, answer={"confirm": True}, answered_by="user:test", answered_at=timezone.now()
        )
        Task.objects.filter(id=task_id).update(
            status="working", status_message="", state_version=F("state_version") + 1
        )
    wait_until(lambda: pushed()[-1]["status"] == "working", timeout=30, what="the answered task pushed as working")
    seen = [(t["status"], sorted(t.get("inputRequests", {}))) for t in pushed()]
    assert seen[-2:] == [("input_required", ["confirm"]), ("working", [])], seen  # not input_required with none
    assert all(a[0] != b[0] for a, b in pairwise(seen)), seen  # one notification per change
    rpc(live, alice.token, "tasks/cancel", {"taskId": task_id}, task_id)  # nothing runs it on: no slice was queued
    wait_until(lambda: stream.closed, timeout=30, what="the listen stream to end once the task is terminal")


def waiting_to_read(table: str) -> bool:
    """Whether a session of the test database waits for a lock to read `table` (a SELECT)."""
    with psycopg.connect(database_url(), autocommit=True) as probe:
        row = probe.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
            " AND wait_event_type = 'Lock' AND query ILIKE 'SELECT%%' AND query LIKE %s",
            [f"%{table}%"],
        ).fetchone()
    return bool(row and row[0])


def test_listen_for_tasks_needs_the_extension(live, alice):
    answer = httpx.post(
        live,
        json=modern_body(5, "subscriptions/listen", {"notifications": {"taskIds": []}}, tasks=False),
        headers=modern_headers(alice.token, "subscriptions/listen"),
        timeout=30,
    )
    assert answer.status_code == 400
    assert answer.json()["error"]["code"] == -32021
    assert answer.json()["error"]["data"] == {"requiredCapabilities": {"extensions": {mc.TASKS: {}}}}


def test_a_synchronous_call_is_answered_when_its_task_ends_not_at_its_next_look(alice, processes, monkeypatch):
    # The waiting request wakes on the task's terminal event (Redis), not at the next look
    # at the database, put out of reach here: without the wakeup the call would time out.
    from mcp_server import shared, views
    from mcp_server.protocol import Message
    from tasks_app.actions import do_create_task
    from tasks_app.streams import wakeups

    monkeypatch.setattr(views, "LOOK_FIRST_SECONDS", 600.0)
    monkeypatch.setattr(views, "LOOK_LONGEST_SECONDS", 600.0)
    monkeypatch.setattr(shared, "SYNC_WAIT_SECONDS", 600.0)  # a worker may take a while to start
    looks = []
    poll = views._poll
    monkeypatch.setattr(views, "_poll", lambda wait, timed_out: looks.append(1) or poll(wait, timed_out))
    task, _ = do_create_task(console(alice.tenant, "user:test"), agent="greet", input={"name": "bench"})
    message = Message(id=7, method="tools/call", params={}, modern=True)

    async def scenario() -> dict:
        async def start_a_worker_after_the_first_look() -> None:
            while not (looks and wakeups._waiters):
                await asyncio.sleep(0.01)
            await asyncio.to_thread(processes.worker)

        starter = asyncio.create_task(start_a_worker_after_the_first_look())
        request = HttpRequest()
        request.META["HTTP_AUTHORIZATION"] = f"Bearer {alice.token}"  # still good at every recheck
        recheck = views.Recheck(request, console(alice.tenant, "user:test"))
        async for item in views._waited(message, shared.wait_for_call(task, modern=True), recheck):
            if item is not None and "method" not in item:
                await starter
                return item
        raise AssertionError("no answer")

    answer = asyncio.run(asyncio.wait_for(scenario(), timeout=120))
    assert answer["id"] == 7 and answer["result"]["isError"] is False, answer
    assert answer["result"]["content"][0]["text"] == "Hello, bench!"
    assert not wakeups._waiters  # the request's wakeup is gone with it
