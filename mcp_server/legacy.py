"""The 2025-11-25 surface (experimental core tasks), for older hosts: one handler per
method (views.py holds the dispatch table). Deletable as one file once those clients
are gone."""

from __future__ import annotations

import base64
import re
from collections.abc import Callable
from typing import Any

from django.conf import settings

from common import json_safety
from mcp_server import elicit, shared, tools
from mcp_server.protocol import (
    INTERNAL_ERROR,
    INVALID_PARAMS,
    LEGACY_VERSIONS,
    METHOD_NOT_FOUND,
    RELATED_TASK,
    SERVER_INFO,
    RpcError,
)
from mcp_server.shared import Call, Wait
from steering_app.actions import do_cancel_task
from tasks_app import access
from tasks_app.errors import IllegalTransition, TaskNotFound
from tasks_app.models import Task
from tasks_app.states import Status

LEGACY_CANCEL_WAIT_SECONDS = 5.0


PAGE_SIZE = 50


def legacy_status(task: Task) -> str:
    """2025-11-25: a tool result with isError makes the task failed."""
    status = task.mcp_status
    if status == "completed" and tools.call_tool_result(task.agent, task.result).get("isError"):
        return "failed"
    return status


def legacy_task(task: Task) -> dict[str, Any]:
    answer: dict[str, Any] = {
        "taskId": str(task.id),
        "status": legacy_status(task),
        "createdAt": shared.iso(task.created_at),
        "lastUpdatedAt": shared.iso(task.updated_at),
        "ttl": shared.ttl_ms(task),
        "pollInterval": shared.POLL_INTERVAL_MS,
    }
    if message := shared.status_message(task):
        answer["statusMessage"] = message[:1000]
    if task.status == Status.FAILED:
        answer.setdefault("statusMessage", shared.tool_error(task)["message"][:1000])
    return answer


def initialize(call: Call) -> dict[str, Any]:
    asked = call.params.get("protocolVersion")
    if "protocolVersion" in call.params and not isinstance(asked, str):
        # Answered with our version, it read as if the client had asked for that one.
        raise RpcError(INVALID_PARAMS, "Invalid params: protocolVersion must be a string")
    return {
        "protocolVersion": asked if asked in LEGACY_VERSIONS else LEGACY_VERSIONS[0],
        "capabilities": {"tools": {}, "tasks": {"list": {}, "cancel": {}, "requests": {"tools": {"call": {}}}}},
        "serverInfo": SERVER_INFO,
    }


def legacy_tools_call(call: Call) -> dict[str, Any] | Wait:
    name, arguments = shared.call_target(call)
    if name in tools.STEERING_TOOLS:
        if "task" in call.params:
            raise RpcError(METHOD_NOT_FOUND, f"the tool {name} does not support task augmentation")
        return shared.steer(call, tools.STEERING_TOOLS[name], arguments)
    agent = shared.find_agent(name)
    support = tools.task_support(agent)
    augmented = isinstance(call.params.get("task"), dict)
    if augmented and support == tools.FORBIDDEN:
        raise RpcError(METHOD_NOT_FOUND, f"the tool {name} does not support task augmentation")
    if not augmented and support == tools.REQUIRED:
        raise RpcError(METHOD_NOT_FOUND, f"the tool {name} must be called as a task (params.task)")
    shared.check_capabilities(call, agent)
    ttl_seconds = settings.RUNTIME_MCP_TASK_TTL_SECONDS
    if augmented and "ttl" in call.params["task"]:
        ttl = call.params["task"]["ttl"]
        # A ttl the request got wrong is its error, not a task with the default TTL in its place.
        if isinstance(ttl, bool) or not isinstance(ttl, int | float) or ttl < 0:
            raise RpcError(INVALID_PARAMS, "Invalid params: task.ttl must be a number of milliseconds, 0 or more")
        if ttl > 0:
            ttl_seconds = max(1, min(int(ttl) // 1000, 90 * 86400))  # the server may override
    task = shared.create(call, agent, arguments, ttl_seconds, waiting=not augmented)
    if isinstance(task, dict):
        return task
    if augmented:
        return {"task": legacy_task(task)}
    return shared.wait_for_call(task, modern=False, progress_token=call.message.meta.get("progressToken"))


def legacy_tasks_get(call: Call) -> dict[str, Any]:
    return legacy_task(shared.find_task(call))


def legacy_tasks_result(call: Call) -> Wait:
    """Blocks until the task is terminal, then answers what the tools/call would have."""
    task = shared.find_task(call)

    def render(task: Task, timed_out: bool) -> dict[str, Any]:
        related = {RELATED_TASK: {"taskId": str(task.id)}}
        if task.status == Status.FAILED:
            raise RpcError(
                INTERNAL_ERROR,
                shared.tool_error(task)["message"],
                {**shared.tool_error(task)["data"], "relatedTask": str(task.id)},
                http_status=200,
            )
        if task.status == Status.COMPLETED:
            return {**tools.call_tool_result(task.agent, task.result), "_meta": related}
        return {**tools.error_result(f"the task was cancelled: {task.cancel_reason or 'cancelled'}"), "_meta": related}

    return Wait(task.id, shared.terminal, render, None, ask=_asker(call))


def _asker(call: Call) -> Callable[[Task], list[dict[str, Any]]] | None:
    """While tasks/result waits: ask the caller each open question it may answer, once per
    stream, if its session declared form elicitation (elicit.py)."""
    who = call.principal
    if not elicit.asks_forms(who, call.message.session_id):
        return None
    asked: set[str] = set()

    def ask(task: Task) -> list[dict[str, Any]]:
        if task.status != Status.INPUT_REQUIRED:
            return []
        return elicit.elicitation_requests(who, task.id, shared.input_requests(task, who), asked)

    return ask


def legacy_session(call: Call) -> str:
    """The Mcp-Session-Id for an initialize answer (elicit.py: signed, nothing stored)."""
    return elicit.mint_session(call.principal, call.params.get("capabilities"))


def legacy_input_response(call: Call) -> bool:
    """A client's JSON-RPC response to an elicitation/create we sent: recorded as tasks/update
    records an answer (a decline, a cancel or an error leaves the question open). False when
    the id is not one this server gave this principal."""
    found = elicit.read_request_id(call.principal, call.message.id)
    if found is None:
        return False
    task_id, key = found
    try:  # answering is an act: the answer rule decides, not the read scope
        task: Task | None = access.task_to_act_on(call.principal, task_id)
    except TaskNotFound:
        task = None
    result = call.message.raw.get("result")
    if task is not None and isinstance(result, dict):
        shared.provide_answers(call, task, {key: result})
    return True


def _cursor(raw: Any) -> int:
    """The offset a nextCursor carries: strict base64 (urlsafe_b64decode drops what is not
    base64, so ['MQ=='] read as "MQ==") of digits only (int() also takes " 1" and "1_0")."""
    if raw is None:
        return 0
    try:
        text = base64.b64decode(raw, altchars=b"-_", validate=True).decode("ascii") if isinstance(raw, str) else ""
    except ValueError:  # binascii.Error and UnicodeDecodeError are ValueErrors
        text = ""
    # it becomes an OFFSET: PostgreSQL's bigint
    if not re.fullmatch(r"[0-9]{1,19}", text) or int(text) > json_safety.MAX_INT:
        raise RpcError(INVALID_PARAMS, "Invalid params: bad cursor")
    return int(text)


def legacy_tasks_list(call: Call) -> dict[str, Any]:
    """Only the caller's own tasks (its API key's user, in its tenant), newest first."""
    start = _cursor(call.params.get("cursor"))
    rows = list(
        access.visible_tasks(call.principal)
        .filter(created_by=call.principal.actor)
        .order_by("-created_at", "-id")[start : start + PAGE_SIZE + 1]
    )
    answer: dict[str, Any] = {"tasks": [legacy_task(t) for t in rows[:PAGE_SIZE]]}
    if len(rows) > PAGE_SIZE:
        answer["nextCursor"] = base64.urlsafe_b64encode(str(start + PAGE_SIZE).encode()).decode()
    return answer


def legacy_tasks_cancel(call: Call) -> dict[str, Any] | Wait:
    task = shared.find_task(call, to_act=True)
    if task.is_terminal:
        raise RpcError(INVALID_PARAMS, f"Cannot cancel task: already in terminal status {task.mcp_status!r}")
    try:
        task = do_cancel_task(task.id, who=call.principal, reason="cancelled over MCP tasks/cancel")
    except IllegalTransition:
        task.refresh_from_db()
        raise RpcError(INVALID_PARAMS, f"Cannot cancel task: already in terminal status {task.mcp_status!r}") from None
    # A worker mid-step stops at its next safe point: give it a moment to get there.
    # Cancelling is not reading: a caller without the read scope gets the Task's status and
    # times, not its message (the agent's question, an error).
    reader = access.may_read(call.principal)
    return Wait(
        task.id,
        shared.terminal,
        lambda t, _: legacy_task(t) if reader else {k: v for k, v in legacy_task(t).items() if k != "statusMessage"},
        LEGACY_CANCEL_WAIT_SECONDS,
    )


def legacy_tools_list(call: Call) -> dict[str, Any]:
    return {"tools": tools.list_tools(legacy=True)}
