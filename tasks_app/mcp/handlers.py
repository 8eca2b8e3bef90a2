"""Thin, synchronous handlers: one per MCP method and era, each over the same domain
functions the REST API calls (tasks_app.actions, steering_app.actions, selectors).

A handler returns a result dict, raises RpcError, or returns a Wait when the answer
depends on a task reaching some state (a synchronous tool call, the legacy blocking
tasks/result); views.py waits for it without holding a thread or a connection.
"""

from __future__ import annotations

import base64
import contextlib
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any
from uuid import UUID

from django.conf import settings
from django.utils import timezone

from common import json_safety
from steering_app.actions import (
    CommandRefused, InvalidCommand, VersionConflict, answer_refusal, do_answer_input, do_enqueue_command,
)
from steering_app.models import InputRequest, InputStatus
from tasks_app.actions import IdempotencyConflict, IllegalTransition, do_cancel_task, do_create_task
from tasks_app.agents import base as agents
from tasks_app.auth import Principal
from tasks_app.mcp import elicit, tools
from tasks_app.mcp.protocol import (
    INTERNAL_ERROR, INVALID_PARAMS, INVALID_REQUEST, LEGACY_VERSIONS, METHOD_NOT_FOUND, MISSING_CAPABILITY, MODERN,
    RELATED_TASK, SERVER_INFO, TASKS_EXT, Message, RpcError, missing_extension,
)
from tasks_app.models import Role, Task
from tasks_app.states import Status

POLL_INTERVAL_MS = 500
SYNC_WAIT_SECONDS = 8.0  # a synchronous tools/call answers within the clients' 10 s budget
LEGACY_CANCEL_WAIT_SECONDS = 5.0
PAGE_SIZE = 50
MAX_LISTEN_TASKS = 100
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


@dataclass
class Listen:
    """A subscriptions/listen stream: the acknowledged filter, then notifications/tasks
    for these tasks of the tenant (views.py streams it)."""

    tenant_id: int
    task_ids: list[UUID]
    acknowledged: dict[str, Any]

    def tasks(self) -> list[dict[str, Any]]:
        """Each task's DetailedTask now, as tasks/get would answer (a purged task drops out)."""
        rows = Task.objects.filter(tenant_id=self.tenant_id, id__in=self.task_ids).order_by("created_at", "id")
        return [modern_task(task) for task in rows]


# --- shared -------------------------------------------------------------------------------

def _iso(value: datetime) -> str:
    return value.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def _require(call: Call, role: str) -> None:
    if not call.principal.has_role(role):
        raise RpcError(INVALID_REQUEST, f"Forbidden: this needs the {role} role or above", http_status=403)


def _find_task(call: Call) -> Task:
    """The caller's tenant's task; another tenant's, a malformed or an expired id is not found."""
    raw = call.params.get("taskId")
    if not isinstance(raw, str):
        raise RpcError(INVALID_PARAMS, "Invalid params: taskId must be a string")
    try:
        task_id = UUID(raw)
    except ValueError:
        raise RpcError(INVALID_PARAMS, "Failed to retrieve task: Task not found") from None
    task = Task.objects.filter(tenant=call.principal.tenant, id=task_id).first()
    if task is None:
        raise RpcError(INVALID_PARAMS, "Failed to retrieve task: Task not found")
    if task.expires_at is not None and task.expires_at <= timezone.now() and task.is_terminal:
        raise RpcError(INVALID_PARAMS, "Failed to retrieve task: Task has expired")
    return task


def _ttl_ms(task: Task) -> int | None:
    if task.expires_at is None:
        return None
    # TTLs are whole seconds; expires_at is computed a moment before created_at is stamped
    return max(1, round((task.expires_at - task.created_at).total_seconds())) * 1000


def _status_message(task: Task) -> str:
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


def _input_requests(task: Task, who: Principal | None = None) -> dict[str, Any]:
    """The open questions as embedded elicitation/create requests; with `who`, only those
    `who` may answer."""
    requests = {}
    for r in InputRequest.objects.filter(task=task, status=InputStatus.OPEN).order_by("id"):
        if who is not None and not may_answer(who, task, r):
            continue
        schema, _ = elicitation_schema(r.answer_schema or {})
        requests[r.key] = {"method": "elicitation/create",
                           "params": {"mode": "form", "message": r.prompt, "requestedSchema": schema}}
    return requests


def _tool_error(task: Task) -> dict[str, Any]:
    error = task.error or {}
    return {"code": INTERNAL_ERROR, "message": str(error.get("message") or task.status_message or "the task failed"),
            "data": {"runtimeError": error, "runtimeStatus": task.status}}


def _create(call: Call, agent: agents.Agent, arguments: dict[str, Any], ttl_seconds: int, *,
            waiting: bool = False) -> Task | dict[str, Any]:
    """A Task row, committed and enqueued, or a tool-error result explaining why not.
    waiting: the caller holds its request open for the result, so the run goes first."""
    who = call.principal
    try:
        task, _ = do_create_task(who.tenant, actor=who.actor, agent=agent.name, input=arguments,
                                 ttl_seconds=ttl_seconds, priority=INTERACTIVE_PRIORITY if waiting else 5)
    except agents.SchemaError as exc:
        return tools.error_result(f"invalid arguments: {exc}")
    except IdempotencyConflict as exc:  # not reachable without a key; kept for completeness
        return tools.error_result(str(exc))
    return task


def _terminal(task: Task) -> bool:
    return task.is_terminal


def _settled(task: Task) -> bool:
    return task.is_terminal or task.status == Status.INPUT_REQUIRED


# --- modern wire (2026-07-28 + io.modelcontextprotocol/tasks) ------------------------------

def modern_task(task: Task) -> dict[str, Any]:
    """The DetailedTask of the extension, from the task row (the fields are the snapshot's)."""
    answer: dict[str, Any] = {
        "taskId": str(task.id), "status": task.mcp_status,
        "createdAt": _iso(task.created_at), "lastUpdatedAt": _iso(task.updated_at),
        "ttlMs": _ttl_ms(task), "pollIntervalMs": POLL_INTERVAL_MS,
    }
    if message := _status_message(task):
        answer["statusMessage"] = message[:1000]
    if task.status == Status.INPUT_REQUIRED:
        answer["inputRequests"] = _input_requests(task)
    elif task.status == Status.COMPLETED:
        answer["result"] = {"resultType": "complete", **tools.call_tool_result(task.agent, task.result)}
    elif task.status == Status.FAILED:
        answer["error"] = _tool_error(task)
        answer.setdefault("statusMessage", answer["error"]["message"][:1000])
    return answer


def discover(call: Call) -> dict[str, Any]:
    return {
        "resultType": "complete", "supportedVersions": [MODERN],
        "capabilities": {"tools": {}, "prompts": {}, "resources": {}, "extensions": {TASKS_EXT: {}}},
        "instructions": "Long-running agents as MCP tools; their runs are durable tasks "
                        "(io.modelcontextprotocol/tasks). Steer a task with the *_task tools.",
        "ttlMs": 60_000, "cacheScope": "private",
    }


def modern_tools_list(call: Call) -> dict[str, Any]:
    return {"resultType": "complete", "tools": tools.list_tools(legacy=False), "ttlMs": 60_000,
            "cacheScope": "private"}


def _empty_list(key: str) -> Callable[[Call], dict[str, Any]]:
    def handler(call: Call) -> dict[str, Any]:
        return {"resultType": "complete", key: [], "ttlMs": 60_000, "cacheScope": "private"}
    return handler


def resources_read(call: Call) -> dict[str, Any]:
    uri = call.params.get("uri")
    raise RpcError(INVALID_PARAMS, f"Resource not found: {uri}", {"uri": uri})


def _preflight(call: Call, agent: agents.Agent, arguments: dict[str, Any]) -> dict[str, Any] | None:
    """MRTR before the task exists: an InputRequiredResult until every question the agent
    needs up front is answered (the answers fill in arguments)."""
    questions = getattr(agent, "mcp_preflight", None)
    if not questions:
        return None
    responses = call.params.get("inputResponses")
    responses = responses if isinstance(responses, dict) else {}
    missing = {}
    for key, question in questions.items():
        response = responses.get(key)
        content = response.get("content") if isinstance(response, dict) else None
        if isinstance(response, dict) and response.get("action") == "accept" and isinstance(content, dict) \
                and isinstance(content.get(question["field"]), str):
            arguments[question["argument"]] = content[question["field"]]
        else:
            missing[key] = {"method": "elicitation/create", "params": {
                "mode": "form", "message": question["message"], "requestedSchema": question["requestedSchema"]}}
    if not missing:
        return None
    if "elicitation" not in call.message.client_capabilities:
        raise RpcError(MISSING_CAPABILITY, f"{agent.name} needs the client's elicitation capability",
                       {"requiredCapabilities": {"elicitation": {}}})
    return {"resultType": "input_required", "inputRequests": missing}


def _call_target(call: Call) -> tuple[str, dict[str, Any]]:
    name, arguments = call.params.get("name"), call.params.get("arguments", {})
    if not isinstance(name, str):
        raise RpcError(INVALID_PARAMS, "Invalid params: name must be a string")
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        raise RpcError(INVALID_PARAMS, "Invalid params: arguments must be an object")
    return name, dict(arguments)


def _agent(name: str) -> agents.Agent:
    try:
        return agents.get_agent(name)
    except agents.UnknownAgent:
        raise RpcError(INVALID_PARAMS, f"Unknown tool: {name}") from None


def _check_capabilities(call: Call, agent: agents.Agent) -> None:
    needed = getattr(agent, "mcp_client_capabilities", None) or {}
    missing = {key: value for key, value in needed.items() if key not in call.message.client_capabilities}
    if missing:
        raise RpcError(MISSING_CAPABILITY, f"{agent.name} needs the client capabilities {sorted(missing)}",
                       {"requiredCapabilities": missing})


def modern_tools_call(call: Call) -> dict[str, Any] | Wait:
    name, arguments = _call_target(call)
    if name in tools.STEERING_TOOLS:
        return {"resultType": "complete", **steer(call, tools.STEERING_TOOLS[name], arguments)}
    agent = _agent(name)
    support = tools.task_support(agent)
    _check_capabilities(call, agent)
    as_task = call.message.has_tasks_extension and support != tools.FORBIDDEN
    if support == tools.REQUIRED and not call.message.has_tasks_extension:
        raise missing_extension(f"the tool {name}")
    if (pending := _preflight(call, agent, arguments)) is not None:
        return pending
    if not call.principal.has_role(Role.OPERATOR):
        return {"resultType": "complete", **tools.error_result("starting a task needs the operator role")}
    task = _create(call, agent, arguments, settings.RUNTIME_MCP_TASK_TTL_SECONDS, waiting=not as_task)
    if isinstance(task, dict):
        return {"resultType": "complete", **task}
    if as_task:  # committed and enqueued: a tasks/get for this id resolves from here on
        created = modern_task(task)
        return {"resultType": "task", **{k: created[k] for k in (
            "taskId", "status", "statusMessage", "createdAt", "lastUpdatedAt", "ttlMs", "pollIntervalMs")
            if k in created}}
    return _wait_for_call(task, modern=True, progress_token=call.message.meta.get("progressToken"))


def _wait_for_call(task: Task, *, modern: bool, progress_token: Any = None) -> Wait:
    """A synchronous tools/call: the run is a task like any other; the caller waits for it."""
    def render(task: Task, timed_out: bool) -> dict[str, Any]:
        if task.status == Status.COMPLETED:
            answer = tools.call_tool_result(task.agent, task.result)
        elif task.status == Status.FAILED:
            raise RpcError(INTERNAL_ERROR, _tool_error(task)["message"], _tool_error(task)["data"],
                           http_status=200)
        elif task.status == Status.CANCELLED:
            answer = tools.error_result(f"the run was cancelled: {task.cancel_reason or 'cancelled'}")
        elif task.status == Status.INPUT_REQUIRED:
            answer = tools.error_result(f"task {task.id} needs input; call this tool with the {TASKS_EXT} "
                                        "extension to answer it")
        else:
            answer = tools.error_result(f"still running after {SYNC_WAIT_SECONDS:g}s; it goes on as task "
                                        f"{task.id} (GET /runtime/tasks/{task.id})")
        return {"resultType": "complete", **answer} if modern else answer
    return Wait(task.id, _settled, render, SYNC_WAIT_SECONDS, progress_token)


def steer(call: Call, tool: tools.SteeringTool, arguments: dict[str, Any]) -> dict[str, Any]:
    """A steering tool: steering_app's do_enqueue_command, with its compare-and-set."""
    task_id, expected = arguments.get("taskId"), arguments.get("expectedVersion")
    if not isinstance(task_id, str) or not isinstance(expected, int) or isinstance(expected, bool):
        return tools.error_result("taskId (string) and expectedVersion (integer) are required")
    if not call.principal.has_role(Role.OPERATOR):
        return tools.error_result("steering needs the operator role")
    try:
        task = _find_task(Call(call.principal, Message(None, "tasks/get", {"taskId": task_id}, modern=True)))
    except RpcError:
        return tools.error_result(f"task {task_id} not found")
    command_id = arguments.get("commandId") or f"mcp-{tool.command}-{secrets.token_hex(8)}"
    try:
        command, _ = do_enqueue_command(
            task.id, tenant=call.principal.tenant, command_id=str(command_id)[:64], type=tool.command,
            payload=tool.payload(arguments), expected_version=expected, requested_by=call.principal.actor,
            reason=str(arguments.get("reason", ""))[:500])
    except VersionConflict as exc:
        return tools.error_result(f"version conflict: {exc}; read the task again (currentVersion "
                                  f"{exc.task.state_version}) and retry with that expectedVersion")
    except (CommandRefused, InvalidCommand) as exc:
        return tools.error_result(f"refused: {exc}")
    task.refresh_from_db()
    body = {"commandId": command.command_id, "type": command.type, "status": command.status,
            "version": command.version, "outcome": command.outcome, "stateVersion": task.state_version,
            "runtimeStatus": task.status}
    text = f"{command.type} {command.status}; the task is {task.status} at version {task.state_version}"
    return {"content": [{"type": "text", "text": text}], "structuredContent": body, "isError": False}


def _require_extension(call: Call) -> None:
    if not call.message.has_tasks_extension:
        raise missing_extension(call.message.method or "this method")


def modern_tasks_get(call: Call) -> dict[str, Any]:
    _require_extension(call)
    return {"resultType": "complete", **modern_task(_find_task(call))}


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
    """Each usable answer becomes a provide_input steering command (as REST's inputs
    endpoint does: the same command id, so the same answer twice is a replay)."""
    who = call.principal
    for key, response in responses.items():
        request = InputRequest.objects.filter(task=task, key=key, status=InputStatus.OPEN).first()
        if request is None or not may_answer(who, task, request):
            continue  # unknown, already answered, superseded or not this caller's to answer: ignored
        usable, answer = answer_from(response, request)
        if not usable:
            continue
        try:
            do_answer_input(task.id, tenant=who.tenant, key=key, answer=answer, requested_by=who.actor,
                            reason="answered over MCP")
        except (VersionConflict, CommandRefused, InvalidCommand):
            continue


def modern_tasks_update(call: Call) -> dict[str, Any]:
    _require_extension(call)
    task = _find_task(call)
    responses = call.params.get("inputResponses")
    if not isinstance(responses, dict):
        raise RpcError(INVALID_PARAMS, "Invalid params: inputResponses must be an object")
    _require(call, Role.OPERATOR)
    provide_answers(call, task, responses)
    return {"resultType": "complete"}


def modern_tasks_cancel(call: Call) -> dict[str, Any]:
    _require_extension(call)
    task = _find_task(call)
    _require(call, Role.OPERATOR)
    # Already terminal: terminal states never change, and the ack is the same.
    with contextlib.suppress(IllegalTransition):
        do_cancel_task(task.id, tenant=call.principal.tenant, actor=call.principal.actor,
                       reason="cancelled over MCP tasks/cancel")
    return {"resultType": "complete"}


def subscriptions_listen(call: Call) -> Listen:
    """Only notifications.taskIds is honoured (the tool, prompt and resource lists never
    change at run time); the ack echoes the ids that are the caller's tenant's tasks."""
    notifications = call.params.get("notifications")
    if not isinstance(notifications, dict):
        raise RpcError(INVALID_PARAMS, "Invalid params: notifications must be an object")
    acknowledged: dict[str, Any] = {}
    found: dict[UUID, str] = {}
    requested = notifications.get("taskIds")
    if requested is not None:
        if not call.message.has_tasks_extension:
            raise missing_extension("subscriptions/listen with notifications.taskIds")
        if not isinstance(requested, list) or not all(isinstance(raw, str) for raw in requested) \
                or len(requested) > MAX_LISTEN_TASKS:
            raise RpcError(INVALID_PARAMS, f"Invalid params: taskIds must be at most {MAX_LISTEN_TASKS} strings")
        wanted: dict[UUID, str] = {}
        for raw in requested:
            try:
                wanted.setdefault(UUID(raw), raw)
            except ValueError:
                continue  # not one of ours: left out of the ack, like another tenant's id
        known = set(Task.objects.filter(tenant=call.principal.tenant, id__in=wanted).values_list("id", flat=True))
        found = {task_id: raw for task_id, raw in wanted.items() if task_id in known}
        acknowledged["taskIds"] = list(found.values())
    return Listen(call.principal.tenant.pk, list(found), acknowledged)


MODERN_METHODS: dict[str, Callable[[Call], Any]] = {
    "server/discover": discover,
    "tools/list": modern_tools_list,
    "tools/call": modern_tools_call,
    "tasks/get": modern_tasks_get,
    "tasks/update": modern_tasks_update,
    "tasks/cancel": modern_tasks_cancel,
    "prompts/list": _empty_list("prompts"),
    "resources/list": _empty_list("resources"),
    "resources/templates/list": _empty_list("resourceTemplates"),
    "resources/read": resources_read,
    "subscriptions/listen": subscriptions_listen,
}


# --- legacy surface (2025-11-25, experimental core tasks) ----------------------------------

def legacy_status(task: Task) -> str:
    """2025-11-25: a tool result with isError makes the task failed."""
    status = task.mcp_status
    if status == "completed" and tools.call_tool_result(task.agent, task.result).get("isError"):
        return "failed"
    return status


def legacy_task(task: Task) -> dict[str, Any]:
    answer: dict[str, Any] = {
        "taskId": str(task.id), "status": legacy_status(task),
        "createdAt": _iso(task.created_at), "lastUpdatedAt": _iso(task.updated_at),
        "ttl": _ttl_ms(task), "pollInterval": POLL_INTERVAL_MS,
    }
    if message := _status_message(task):
        answer["statusMessage"] = message[:1000]
    if task.status == Status.FAILED:
        answer.setdefault("statusMessage", _tool_error(task)["message"][:1000])
    return answer


def initialize(call: Call) -> dict[str, Any]:
    asked = call.params.get("protocolVersion")
    return {
        "protocolVersion": asked if asked in LEGACY_VERSIONS else LEGACY_VERSIONS[0],
        "capabilities": {"tools": {}, "tasks": {"list": {}, "cancel": {}, "requests": {"tools": {"call": {}}}}},
        "serverInfo": SERVER_INFO,
    }


def legacy_tools_call(call: Call) -> dict[str, Any] | Wait:
    name, arguments = _call_target(call)
    if name in tools.STEERING_TOOLS:
        if "task" in call.params:
            raise RpcError(METHOD_NOT_FOUND, f"the tool {name} does not support task augmentation")
        return steer(call, tools.STEERING_TOOLS[name], arguments)
    agent = _agent(name)
    support = tools.task_support(agent)
    augmented = isinstance(call.params.get("task"), dict)
    if augmented and support == tools.FORBIDDEN:
        raise RpcError(METHOD_NOT_FOUND, f"the tool {name} does not support task augmentation")
    if not augmented and support == tools.REQUIRED:
        raise RpcError(METHOD_NOT_FOUND, f"the tool {name} must be called as a task (params.task)")
    _check_capabilities(call, agent)
    if not call.principal.has_role(Role.OPERATOR):
        return tools.error_result("starting a task needs the operator role")
    ttl_seconds = settings.RUNTIME_MCP_TASK_TTL_SECONDS
    if augmented and isinstance(call.params["task"].get("ttl"), int) and call.params["task"]["ttl"] > 0:
        ttl_seconds = max(1, min(call.params["task"]["ttl"] // 1000, 90 * 86400))  # the server may override
    task = _create(call, agent, arguments, ttl_seconds, waiting=not augmented)
    if isinstance(task, dict):
        return task
    if augmented:
        return {"task": legacy_task(task)}
    return _wait_for_call(task, modern=False, progress_token=call.message.meta.get("progressToken"))


def legacy_tasks_get(call: Call) -> dict[str, Any]:
    return legacy_task(_find_task(call))


def legacy_tasks_result(call: Call) -> Wait:
    """Blocks until the task is terminal, then answers what the tools/call would have."""
    task = _find_task(call)

    def render(task: Task, timed_out: bool) -> dict[str, Any]:
        related = {RELATED_TASK: {"taskId": str(task.id)}}
        if task.status == Status.FAILED:
            raise RpcError(INTERNAL_ERROR, _tool_error(task)["message"],
                           {**_tool_error(task)["data"], "relatedTask": str(task.id)}, http_status=200)
        if task.status == Status.COMPLETED:
            return {**tools.call_tool_result(task.agent, task.result), "_meta": related}
        return {**tools.error_result(f"the task was cancelled: {task.cancel_reason or 'cancelled'}"),
                "_meta": related}
    return Wait(task.id, _terminal, render, None, ask=_asker(call))


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
        return elicit.elicitation_requests(who, task.id, _input_requests(task, who), asked)
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
    task = Task.objects.filter(tenant=call.principal.tenant, id=task_id).first()
    result = call.message.raw.get("result")
    if task is not None and isinstance(result, dict):
        provide_answers(call, task, {key: result})
    return True


def _cursor(raw: Any) -> int:
    if raw is None:
        return 0
    try:
        value = int(base64.urlsafe_b64decode(str(raw).encode()).decode())
    except (ValueError, UnicodeDecodeError):
        raise RpcError(INVALID_PARAMS, "Invalid params: bad cursor") from None
    if not 0 <= value <= json_safety.MAX_INT:  # it becomes an OFFSET: PostgreSQL's bigint
        raise RpcError(INVALID_PARAMS, "Invalid params: bad cursor")
    return value


def legacy_tasks_list(call: Call) -> dict[str, Any]:
    """Only the caller's own tasks (its API key's user, in its tenant), newest first."""
    start = _cursor(call.params.get("cursor"))
    rows = list(Task.objects.filter(tenant=call.principal.tenant, created_by=call.principal.actor)
                .order_by("-created_at", "-id")[start:start + PAGE_SIZE + 1])
    answer: dict[str, Any] = {"tasks": [legacy_task(t) for t in rows[:PAGE_SIZE]]}
    if len(rows) > PAGE_SIZE:
        answer["nextCursor"] = base64.urlsafe_b64encode(str(start + PAGE_SIZE).encode()).decode()
    return answer


def legacy_tasks_cancel(call: Call) -> dict[str, Any] | Wait:
    task = _find_task(call)
    _require(call, Role.OPERATOR)
    if task.is_terminal:
        raise RpcError(INVALID_PARAMS, f"Cannot cancel task: already in terminal status {task.mcp_status!r}")
    try:
        task = do_cancel_task(task.id, tenant=call.principal.tenant, actor=call.principal.actor,
                              reason="cancelled over MCP tasks/cancel")
    except IllegalTransition:
        task.refresh_from_db()
        raise RpcError(INVALID_PARAMS, f"Cannot cancel task: already in terminal status {task.mcp_status!r}") \
            from None
    # A worker mid-step stops at its next safe point: give it a moment to get there.
    return Wait(task.id, _terminal, lambda t, _: legacy_task(t), LEGACY_CANCEL_WAIT_SECONDS)


def ping(call: Call) -> dict[str, Any]:
    return {}


LEGACY_METHODS: dict[str, Callable[[Call], Any]] = {
    "initialize": initialize,
    "ping": ping,
    "tools/list": lambda call: {"tools": tools.list_tools(legacy=True)},
    "tools/call": legacy_tools_call,
    "tasks/get": legacy_tasks_get,
    "tasks/result": legacy_tasks_result,
    "tasks/list": legacy_tasks_list,
    "tasks/cancel": legacy_tasks_cancel,
}


def dispatch(call: Call) -> dict[str, Any] | Wait | Listen:
    table = MODERN_METHODS if call.message.modern else LEGACY_METHODS
    handler = table.get(call.message.method or "")
    if handler is None:
        raise RpcError(METHOD_NOT_FOUND, f"Method not found: {call.message.method}")
    return handler(call)
