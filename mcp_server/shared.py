"""What both MCP wires share: the call and its wait, finding the caller's task, creating
a run, steering, and turning answers into provide_input commands. Every handler is thin,
synchronous and over the same domain functions the REST API calls (tasks_app.actions,
steering_app.actions, selectors).

A handler returns a result dict, raises RpcError, or returns a Wait when the answer
depends on a task reaching some state (a synchronous tool call, the legacy blocking
tasks/result); views.py waits for it without holding a thread or a connection.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any
from uuid import UUID

from django.utils import timezone

from common.schema import SchemaError, validate
from mcp_server import tools
from mcp_server.protocol import (
    INTERNAL_ERROR,
    INVALID_PARAMS,
    MISSING_CAPABILITY,
    TASKS_EXT,
    Message,
    RpcError,
)
from steering_app.actions import do_answer_input, do_enqueue_command
from steering_app.models import InputRequest, InputStatus
from tasks_app import access, errors, kills
from tasks_app.access import answer_refusal
from tasks_app.actions import do_create_task
from tasks_app.agents import base as agents
from tasks_app.auth import Principal
from tasks_app.errors import (
    CommandRefused,
    Forbidden,
    IdempotencyConflict,
    InvalidCommand,
    QuotaExceeded,
    TaskNotFound,
    VersionConflict,
)
from tasks_app.models import Task
from tasks_app.states import Status

POLL_INTERVAL_MS = 500


SYNC_WAIT_SECONDS = 8.0  # a synchronous tools/call answers within the clients' 10 s budget


INTERACTIVE_PRIORITY = 0  # a synchronous tools/call: someone is waiting on the open request


@dataclass
class Call:
    principal: Principal
    message: Message

    @property
    def params(self) -> dict[str, Any]:
        return self.message.params


@dataclass
class Wait:
    """Answer once done(task) holds (or the deadline passes) with render(task, timed_out)."""

    task_id: UUID
    done: Callable[[Task], bool]
    render: Callable[[Task, bool], dict[str, Any]]
    seconds: float | None  # None: no deadline (keep-alives keep the stream open)
    progress_token: Any = None
    # While waiting: JSON-RPC requests to send the client on the stream (legacy elicitation).
    ask: Callable[[Task], list[dict[str, Any]]] | None = None


def iso(value: datetime) -> str:
    return value.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def rpc_error(exc: Exception) -> RpcError:
    """A domain error a handler let through, as tasks_app.errors.DOMAIN_ERRORS says MCP answers it."""
    answer = errors.answer_for(exc)
    assert answer is not None, exc
    return RpcError(answer.rpc_code, errors.rpc_message(exc, answer), http_status=answer.rpc_http_status)


def find_task(call: Call, *, to_act: bool = False) -> Task:
    """The caller's tenant's task; another tenant's, a malformed or an expired id is not found
    (TaskNotFound: views.py answers it through the table). To read it (to_act=False) needs the
    read scope (tasks_app.access: Forbidden, answered through the same table); to act on it,
    the action's own rule."""
    raw = call.params.get("taskId")
    if not isinstance(raw, str):
        raise RpcError(INVALID_PARAMS, "Invalid params: taskId must be a string")
    task = access.task_to_act_on(call.principal, raw) if to_act else access.task_for(call.principal, raw)
    if task.expires_at is not None and task.expires_at <= timezone.now() and task.is_terminal:
        raise RpcError(INVALID_PARAMS, "Failed to retrieve task: Task has expired")
    return task


def ttl_ms(task: Task) -> int | None:
    if task.expires_at is None:
        return None
    # TTLs are whole seconds; expires_at is computed a moment before created_at is stamped
    return max(1, round((task.expires_at - task.created_at).total_seconds())) * 1000


def status_message(task: Task) -> str:
    """Phase, progress and the agent's message in one line (polling clients see progress here)."""
    parts = []
    if task.mcp_status == "working":
        if task.phase:
            parts.append(task.phase)
        if task.progress:
            parts.append(f"{round(task.progress, 4):.0%}")
    if message := task.status_text():
        parts.append(message)
    return " · ".join(parts)


def elicitation_schema(schema: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """An elicitation form needs an object of primitives; other answers are wrapped in
    {"answer": ...}. Returns (requestedSchema, wrapped)."""
    if schema.get("type") == "object" and isinstance(schema.get("properties"), dict):
        return schema, False
    return {"type": "object", "properties": {"answer": schema}, "required": ["answer"]}, True


def input_requests(task: Task, who: Principal | None = None) -> dict[str, Any]:
    """The open questions as embedded elicitation/create requests; with `who`, only those
    `who` may answer."""
    requests = {}
    for r in InputRequest.objects.filter(task=task, status=InputStatus.OPEN).order_by("id"):
        if who is not None and not may_answer(who, task, r):
            continue
        schema, _ = elicitation_schema(r.answer_schema or {})
        requests[r.key] = {
            "method": "elicitation/create",
            "params": {"mode": "form", "message": r.prompt, "requestedSchema": schema},
        }
    return requests


def tool_error(task: Task) -> dict[str, Any]:
    error = task.error or {}
    return {
        "code": INTERNAL_ERROR,
        "message": str(error.get("message") or task.status_message or "the task failed"),
        "data": {"runtimeError": error, "runtimeStatus": task.status},
    }


def create(
    call: Call, agent: agents.Agent, arguments: dict[str, Any], ttl_seconds: int, *, waiting: bool = False
) -> Task | dict[str, Any]:
    """A Task row, committed and enqueued, or a tool-error result explaining why not.
    waiting: the caller holds its request open for the result, so the run goes first."""
    try:
        task, _ = do_create_task(
            call.principal,
            agent=agent.name,
            input=arguments,
            ttl_seconds=ttl_seconds,
            priority=INTERACTIVE_PRIORITY if waiting else 5,
        )
    except Forbidden:
        return tools.error_result("starting a task needs the operator role")
    except (SchemaError, IdempotencyConflict, QuotaExceeded) as exc:  # the second not reachable without a key
        return tools.error_result(errors.tool_message(exc))
    return task


def terminal(task: Task) -> bool:
    return task.is_terminal


def settled(task: Task) -> bool:
    return task.is_terminal or task.status == Status.INPUT_REQUIRED


def call_target(call: Call) -> tuple[str, dict[str, Any]]:
    name, arguments = call.params.get("name"), call.params.get("arguments", {})
    if not isinstance(name, str):
        raise RpcError(INVALID_PARAMS, "Invalid params: name must be a string")
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        raise RpcError(INVALID_PARAMS, "Invalid params: arguments must be an object")
    return name, dict(arguments)


def find_agent(name: str) -> agents.Agent:
    try:
        return agents.get_agent(name)
    except agents.UnknownAgent:
        raise RpcError(INVALID_PARAMS, f"Unknown tool: {name}") from None


def check_capabilities(call: Call, agent: agents.Agent) -> None:
    needed = agent.mcp.client_capabilities
    missing = {key: value for key, value in needed.items() if key not in call.message.client_capabilities}
    if missing:
        raise RpcError(
            MISSING_CAPABILITY,
            f"{agent.name} needs the client capabilities {sorted(missing)}",
            {"requiredCapabilities": missing},
        )


def wait_for_call(task: Task, *, modern: bool, progress_token: Any = None) -> Wait:
    """A synchronous tools/call: the run is a task like any other; the caller waits for it."""

    def render(task: Task, timed_out: bool) -> dict[str, Any]:
        if task.status == Status.COMPLETED:
            answer = tools.call_tool_result(task.agent, task.result)
        elif task.status == Status.FAILED:
            raise RpcError(INTERNAL_ERROR, tool_error(task)["message"], tool_error(task)["data"], http_status=200)
        elif task.status == Status.CANCELLED:
            answer = tools.error_result(f"the run was cancelled: {task.cancel_reason or 'cancelled'}")
        elif task.status == Status.INPUT_REQUIRED:
            answer = tools.error_result(
                f"task {task.id} needs input; call this tool with the {TASKS_EXT} extension to answer it"
            )
        else:
            answer = tools.error_result(
                f"still running after {SYNC_WAIT_SECONDS:g}s; it goes on as task "
                f"{task.id} (GET /runtime/tasks/{task.id})"
            )
        return {"resultType": "complete", **answer} if modern else answer

    return Wait(task.id, settled, render, SYNC_WAIT_SECONDS, progress_token)


def steer(call: Call, tool: tools.SteeringTool, arguments: dict[str, Any]) -> dict[str, Any]:
    """A steering tool: steering_app's do_enqueue_command, with its compare-and-set. Its
    arguments are held to the tool's own inputSchema first (-32602 naming the field): a
    wrong type, a missing field or one the schema does not name never reaches the domain."""
    try:
        validate(arguments, tool.definition()["inputSchema"], "arguments")
    except SchemaError as exc:
        raise RpcError(INVALID_PARAMS, f"Invalid params: {exc}") from None
    task_id, expected, reason = arguments["taskId"], arguments["expectedVersion"], arguments.get("reason", "")
    try:
        task = find_task(
            Call(call.principal, Message(None, "tasks/get", {"taskId": task_id}, modern=True)), to_act=True
        )
    except (RpcError, TaskNotFound):
        return tools.error_result(f"task {task_id} not found")
    command_id = arguments.get("commandId") or f"mcp-{tool.command}-{secrets.token_hex(8)}"
    try:
        command, _ = do_enqueue_command(
            task.id,
            who=call.principal,
            command_id=command_id,
            type=tool.command,
            payload=tool.payload(arguments),
            expected_version=expected,
            reason=reason,
        )
    except (Forbidden, VersionConflict, CommandRefused, InvalidCommand) as exc:
        return tools.error_result(errors.tool_message(exc))
    task.refresh_from_db()
    body = {
        "commandId": command.command_id,
        "type": command.type,
        "status": command.status,
        "version": command.version,
        "outcome": command.outcome,
        "stateVersion": task.state_version,
        "runtimeStatus": task.status,
        **({"killPolicy": kills.policy()} if command.type == "kill" else {}),
    }
    text = f"{command.type} {command.status}; the task is {task.status} at version {task.state_version}"
    return {"content": [{"type": "text", "text": text}], "structuredContent": body, "isError": False}


def answer_from(response: Any, request: InputRequest) -> tuple[bool, Any]:
    """An ElicitResult as the answer the agent asked for: (usable, answer). Only an
    accepted form answers; a decline or cancel leaves the question open."""
    if not isinstance(response, dict) or response.get("action") != "accept":
        return False, None
    content = response.get("content")
    if not isinstance(content, dict):
        return False, None
    _, wrapped = elicitation_schema(request.answer_schema or {})
    if wrapped:
        return ("answer" in content), content.get("answer")
    return True, content


def may_answer(who: Principal, task: Task, request: InputRequest) -> bool:
    return answer_refusal(who, task, request.kind) is None


def provide_answers(call: Call, task: Task, responses: dict[str, Any]) -> None:
    """Each usable answer becomes a provide_input command (as REST's inputs endpoint does:
    the same command id, so the same answer twice is a replay). An open question the caller
    may not answer (an approval without the approve scope, say) refuses the whole update
    with Forbidden, which the error table answers (403) as it does on REST: acking it
    would say "accepted" while nothing happens."""
    who = call.principal
    open_requests = {
        r.key: r for r in InputRequest.objects.filter(task=task, key__in=list(responses), status=InputStatus.OPEN)
    }
    refused = {key: why for key, r in open_requests.items() if (why := answer_refusal(who, task, r.kind))}
    if refused:
        raise Forbidden("; ".join(f"{key}: {why}" for key, why in sorted(refused.items())))
    for key, response in responses.items():
        request = open_requests.get(key)
        if request is None:
            continue  # unknown, already answered or superseded: ignored (the extension's SHOULD)
        usable, answer = answer_from(response, request)
        if not usable:
            continue
        try:
            do_answer_input(task.id, who=who, key=key, answer=answer, reason="answered over MCP")
        except (VersionConflict, CommandRefused, InvalidCommand, Forbidden):
            continue


def ping(call: Call) -> dict[str, Any]:
    return {}
