"""The 2026-07-28 wire with the io.modelcontextprotocol/tasks extension: one handler per
method (views.py holds the dispatch table); what both wires share is in shared.py."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from uuid import UUID

from django.conf import settings

from mcp_server import shared, tools
from mcp_server.protocol import INVALID_PARAMS, MISSING_CAPABILITY, MODERN, TASKS_EXT, RpcError, missing_extension
from mcp_server.shared import Call, Wait
from steering_app.actions import do_cancel_task
from tasks_app import access, selectors
from tasks_app.agents import base as agents
from tasks_app.errors import IllegalTransition
from tasks_app.models import Task
from tasks_app.states import Status

MAX_LISTEN_TASKS = 100


@dataclass
class Listen:
    """A subscriptions/listen stream: the acknowledged filter, then notifications/tasks
    for these tasks of the tenant (views.py streams it)."""

    tenant_id: int
    task_ids: list[UUID]
    acknowledged: dict[str, Any]

    def tasks(self) -> list[dict[str, Any]]:
        """Each task's DetailedTask now, as tasks/get would answer (a purged task drops out).
        One snapshot for the rows and their open questions: read apart, an answer landing
        between them showed an input_required task with no question, which the listen
        pushed as one more change."""
        with selectors.one_snapshot():
            rows = Task.objects.for_tenant(self.tenant_id).filter(id__in=self.task_ids).order_by("created_at", "id")
            return [modern_task(task) for task in rows]


def modern_task(task: Task) -> dict[str, Any]:
    """The DetailedTask of the extension, from the task row (the fields are the snapshot's)."""
    answer: dict[str, Any] = {
        "taskId": str(task.id),
        "status": task.mcp_status,
        "createdAt": shared.iso(task.created_at),
        "lastUpdatedAt": shared.iso(task.updated_at),
        "ttlMs": shared.ttl_ms(task),
        "pollIntervalMs": shared.POLL_INTERVAL_MS,
    }
    if message := shared.status_message(task):
        answer["statusMessage"] = message[:1000]
    if task.status == Status.INPUT_REQUIRED:
        answer["inputRequests"] = shared.input_requests(task)
    elif task.status == Status.COMPLETED:
        answer["result"] = {"resultType": "complete", **tools.call_tool_result(task.agent, task.result)}
    elif task.status == Status.FAILED:
        answer["error"] = shared.tool_error(task)
        answer.setdefault("statusMessage", answer["error"]["message"][:1000])
    return answer


def discover(call: Call) -> dict[str, Any]:
    return {
        "resultType": "complete",
        "supportedVersions": [MODERN],
        "capabilities": {"tools": {}, "prompts": {}, "resources": {}, "extensions": {TASKS_EXT: {}}},
        "instructions": "Long-running agents as MCP tools; their runs are durable tasks "
        "(io.modelcontextprotocol/tasks). Steer a task with the *_task tools.",
        "ttlMs": 60_000,
        "cacheScope": "private",
    }


def modern_tools_list(call: Call) -> dict[str, Any]:
    return {"resultType": "complete", "tools": tools.list_tools(legacy=False), "ttlMs": 60_000, "cacheScope": "private"}


def empty_list(key: str) -> Callable[[Call], dict[str, Any]]:
    def handler(call: Call) -> dict[str, Any]:
        return {"resultType": "complete", key: [], "ttlMs": 60_000, "cacheScope": "private"}

    return handler


def resources_read(call: Call) -> dict[str, Any]:
    uri = call.params.get("uri")
    raise RpcError(INVALID_PARAMS, f"Resource not found: {uri}", {"uri": uri})


def _preflight(call: Call, agent: agents.Agent, arguments: dict[str, Any]) -> dict[str, Any] | None:
    """MRTR before the task exists: an InputRequiredResult until every question the agent
    needs up front is answered (the answers fill in arguments)."""
    questions = agent.mcp.preflight
    if not questions:
        return None
    responses = call.params.get("inputResponses")
    responses = responses if isinstance(responses, dict) else {}
    missing = {}
    for key, question in questions.items():
        response = responses.get(key)
        content = response.get("content") if isinstance(response, dict) else None
        if (
            isinstance(response, dict)
            and response.get("action") == "accept"
            and isinstance(content, dict)
            and isinstance(content.get(question["field"]), str)
        ):
            arguments[question["argument"]] = content[question["field"]]
        else:
            missing[key] = {
                "method": "elicitation/create",
                "params": {
                    "mode": "form",
                    "message": question["message"],
                    "requestedSchema": question["requestedSchema"],
                },
            }
    if not missing:
        return None
    if "elicitation" not in call.message.client_capabilities:
        raise RpcError(
            MISSING_CAPABILITY,
            f"{agent.name} needs the client's elicitation capability",
            {"requiredCapabilities": {"elicitation": {}}},
        )
    return {"resultType": "input_required", "inputRequests": missing}


def modern_tools_call(call: Call) -> dict[str, Any] | Wait:
    name, arguments = shared.call_target(call)
    if name in tools.STEERING_TOOLS:
        return {"resultType": "complete", **shared.steer(call, tools.STEERING_TOOLS[name], arguments)}
    agent = shared.find_agent(name)
    support = tools.task_support(agent)
    shared.check_capabilities(call, agent)
    as_task = call.message.has_tasks_extension and support != tools.FORBIDDEN
    if support == tools.REQUIRED and not call.message.has_tasks_extension:
        raise missing_extension(f"the tool {name}")
    if (pending := _preflight(call, agent, arguments)) is not None:
        return pending
    task = shared.create(call, agent, arguments, settings.RUNTIME_MCP_TASK_TTL_SECONDS, waiting=not as_task)
    if isinstance(task, dict):
        return {"resultType": "complete", **task}
    if as_task:  # committed and enqueued: a tasks/get for this id resolves from here on
        created = modern_task(task)
        return {
            "resultType": "task",
            **{
                k: created[k]
                for k in ("taskId", "status", "statusMessage", "createdAt", "lastUpdatedAt", "ttlMs", "pollIntervalMs")
                if k in created
            },
        }
    return shared.wait_for_call(task, modern=True, progress_token=call.message.meta.get("progressToken"))


def _require_extension(call: Call) -> None:
    if not call.message.has_tasks_extension:
        raise missing_extension(call.message.method or "this method")


def modern_tasks_get(call: Call) -> dict[str, Any]:
    _require_extension(call)
    with selectors.one_snapshot():  # the status and its open questions of one moment (Listen.tasks)
        return {"resultType": "complete", **modern_task(shared.find_task(call))}


def modern_tasks_update(call: Call) -> dict[str, Any]:
    _require_extension(call)
    task = shared.find_task(call, to_act=True)
    responses = call.params.get("inputResponses")
    if not isinstance(responses, dict):
        raise RpcError(INVALID_PARAMS, "Invalid params: inputResponses must be an object")
    # No role check here: an approval needs the approve scope, not operate (an approve-only
    # key must be able to answer it); provide_answers asks answer_refusal per question.
    shared.provide_answers(call, task, responses)
    return {"resultType": "complete"}


def modern_tasks_cancel(call: Call) -> dict[str, Any]:
    _require_extension(call)
    task = shared.find_task(call, to_act=True)
    # Already terminal: terminal states never change, and the ack is the same.
    with contextlib.suppress(IllegalTransition):
        do_cancel_task(task.id, who=call.principal, reason="cancelled over MCP tasks/cancel")
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
        if (
            not isinstance(requested, list)
            or not all(isinstance(raw, str) for raw in requested)
            or len(requested) > MAX_LISTEN_TASKS
        ):
            raise RpcError(INVALID_PARAMS, f"Invalid params: taskIds must be at most {MAX_LISTEN_TASKS} strings")
        wanted: dict[UUID, str] = {}
        for raw in requested:
            try:
                wanted.setdefault(UUID(raw), raw)
            except ValueError:
                continue  # not one of ours: left out of the ack, like another tenant's id
        known = set(access.visible_tasks(call.principal).filter(id__in=wanted).values_list("id", flat=True))
        found = {task_id: raw for task_id, raw in wanted.items() if task_id in known}
        acknowledged["taskIds"] = list(found.values())
    return Listen(call.principal.tenant.pk, list(found), acknowledged)
