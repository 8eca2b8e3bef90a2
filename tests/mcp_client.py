"""The tasks-extension client helper of MCP-TASKS.md §6.1, over the official SDK (mcp 2.x).

The SDK has no tasks runtime of its own; this is the ~60-line helper its extension API
makes possible. poll() answers input requests through `answer` (key, request) -> ElicitResult.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any, Literal

import httpx2
from mcp import Client, types
from mcp.client import ClaimContext, ClientExtension, ResultClaim
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError
from pydantic import TypeAdapter

TASKS = "io.modelcontextprotocol/tasks"
RAW = TypeAdapter(dict[str, Any])
TERMINAL = ("completed", "failed", "cancelled")


class TaskIdParams(types.RequestParams):
    task_id: str


class UpdateParams(types.RequestParams):
    task_id: str
    input_responses: dict[str, Any]


class GetTask(types.Request[TaskIdParams, Literal["tasks/get"]]):
    method: Literal["tasks/get"] = "tasks/get"
    params: TaskIdParams
    name_param = "taskId"


class UpdateTask(types.Request[UpdateParams, Literal["tasks/update"]]):
    method: Literal["tasks/update"] = "tasks/update"
    params: UpdateParams
    name_param = "taskId"


class CancelTask(types.Request[TaskIdParams, Literal["tasks/cancel"]]):
    method: Literal["tasks/cancel"] = "tasks/cancel"
    params: TaskIdParams
    name_param = "taskId"


class CreateTaskResult(types.Result):
    result_type: Literal["task"] = "task"
    task_id: str
    status: str
    status_message: str | None = None
    created_at: str
    last_updated_at: str
    ttl_ms: int | None
    poll_interval_ms: int | None = None


class Ack(types.Result):
    result_type: str | None = None


Answer = Callable[[str, dict[str, Any]], dict[str, Any] | None]


async def get_task(session: Any, task_id: str) -> dict[str, Any]:
    return await session.send_request(GetTask(params=TaskIdParams(task_id=task_id)), RAW)


async def update_task(session: Any, task_id: str, responses: dict[str, Any]) -> Any:
    return await session.send_request(UpdateTask(params=UpdateParams(task_id=task_id, input_responses=responses)), Ack)


async def cancel_task(session: Any, task_id: str) -> Any:
    return await session.send_request(CancelTask(params=TaskIdParams(task_id=task_id)), Ack)


async def poll(
    session: Any,
    task_id: str,
    *,
    answer: Answer | None = None,
    timeout: float = 60,
    seen: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Poll tasks/get (honouring pollIntervalMs) until terminal, answering each input key once."""
    deadline, answered = time.monotonic() + timeout, set()
    while True:
        task = await get_task(session, task_id)
        if seen is not None:
            seen.append(task)
        if task["status"] in TERMINAL:
            return task
        if task["status"] == "input_required" and answer is not None:
            fresh = {k: answer(k, r) for k, r in task.get("inputRequests", {}).items() if k not in answered}
            fresh = {k: v for k, v in fresh.items() if v is not None}
            if fresh:
                await update_task(session, task_id, fresh)
                answered |= set(fresh)
        if time.monotonic() > deadline:
            raise AssertionError(f"task {task_id} still {task['status']} after {timeout}s")
        await asyncio.sleep(min(task.get("pollIntervalMs", 500), 500) / 1000)


class TasksClient(ClientExtension):
    identifier = TASKS

    def __init__(self, answer: Answer | None = None) -> None:
        self.answer = answer

    def claims(self) -> list[ResultClaim]:
        return [ResultClaim(result_type="task", model=CreateTaskResult, resolve=self._resolve)]

    async def _resolve(self, created: CreateTaskResult, ctx: ClaimContext) -> types.CallToolResult:
        task = await poll(ctx.session, created.task_id, answer=self.answer)
        if task["status"] == "completed":
            return types.CallToolResult.model_validate(task["result"])
        if task["status"] == "failed":
            raise MCPError(code=task["error"]["code"], message=task["error"]["message"])
        return types.CallToolResult(content=[types.TextContent(type="text", text="cancelled")], is_error=True)


def client(url: str, token: str, *, tasks: bool = True, answer: Answer | None = None, **kwargs: Any) -> Client:
    """An SDK Client on the live server, authenticated by API key (modern wire by discovery)."""
    http = httpx2.AsyncClient(headers={"Authorization": f"Bearer {token}"}, timeout=httpx2.Timeout(30, read=120))
    return Client(
        streamable_http_client(url, http_client=http), extensions=[TasksClient(answer)] if tasks else [], **kwargs
    )
