"""A small remote MCP server for the ledger's mcp.call tests, built with the official SDK
(`mcp` 2.3.0). It is the independent receiver: it counts every tools/call it executes and
serves the counts on GET /stats, so tests never count effects from our own tables.

Tools:
  record(text)       a plain synchronous tool; one effect per call
  long_job(seconds)  with the io.modelcontextprotocol/tasks extension declared by the client,
                     answers with a task (one effect per call) that completes `seconds` later
  slow(seconds)      sleeps, then records; the caller's timeout decides whether it ever answers

Run: python tests/mcp_remote.py --port N [--token T]
"""

from __future__ import annotations

import argparse
import asyncio
import secrets
import time
from collections import Counter
from datetime import UTC, datetime
from typing import Any

import uvicorn
from mcp.server.context import ServerRequestContext
from mcp.server.extension import Extension, MethodBinding
from mcp.server.mcpserver import MCPServer
from mcp_types import CallToolRequestParams, RequestParams
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Mount, Route

TASKS = "io.modelcontextprotocol/tasks"
effects: Counter[str] = Counter()  # tool name -> calls executed
tasks: dict[str, dict[str, Any]] = {}
polls: Counter[str] = Counter()  # task id -> tasks/get answered
traceparents: list[str] = []  # the traceparent header of each /mcp request that carried one


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).isoformat().replace("+00:00", "Z")


def _declared_tasks(ctx: ServerRequestContext[Any, Any]) -> bool:
    meta = (
        ctx.meta.model_dump(by_alias=True)
        if ctx.meta is not None and hasattr(ctx.meta, "model_dump")
        else (ctx.meta or {})
    )
    caps = meta.get("io.modelcontextprotocol/clientCapabilities") or {}
    return TASKS in (caps.get("extensions") or {})


class TaskIdParams(RequestParams):
    task_id: str


class Tasks(Extension):
    identifier = TASKS

    def methods(self):
        return [MethodBinding(method="tasks/get", params_type=TaskIdParams, handler=self.get)]

    async def intercept_tool_call(self, params: CallToolRequestParams, ctx, call_next):
        if params.name != "long_job" or not _declared_tasks(ctx):
            return await call_next(ctx)
        effects["long_job"] += 1
        now = time.time()
        task_id = secrets.token_urlsafe(16)
        tasks[task_id] = {
            "created": now,
            "done_at": now + float((params.arguments or {}).get("seconds", 1)),
            "arguments": params.arguments or {},
        }
        return {
            "resultType": "task",
            "taskId": task_id,
            "status": "working",
            "statusMessage": "started",
            "createdAt": _iso(now),
            "lastUpdatedAt": _iso(now),
            "ttlMs": 3_600_000,
            "pollIntervalMs": 200,
        }

    async def get(self, ctx, params: TaskIdParams):
        from mcp.shared.exceptions import MCPError

        task = tasks.get(params.task_id)
        if task is None:
            raise MCPError(code=-32602, message="Task not found")
        polls[params.task_id] += 1
        now = time.time()
        base = {
            "resultType": "complete",
            "taskId": params.task_id,
            "createdAt": _iso(task["created"]),
            "lastUpdatedAt": _iso(now),
            "ttlMs": 3_600_000,
            "pollIntervalMs": 200,
        }
        if now < task["done_at"]:
            return {**base, "status": "working", "statusMessage": f"{task['done_at'] - now:.1f}s to go"}
        text = f"done: {task['arguments'].get('label', '')}"
        return {
            **base,
            "status": "completed",
            "result": {
                "content": [{"type": "text", "text": text}],
                "structuredContent": {"label": task["arguments"].get("label", "")},
                "isError": False,
            },
        }


server = MCPServer("ledger-test-remote", extensions=[Tasks()])


@server.tool()
def record(text: str) -> str:
    """Records one effect and echoes the text."""
    effects["record"] += 1
    return f"recorded {text}"


@server.tool()
def long_job(seconds: float, label: str = "") -> str:
    """Without the tasks extension: runs inline."""
    effects["long_job_inline"] += 1
    return f"done: {label}"


@server.tool()
async def slow(seconds: float) -> str:
    """Answers after `seconds`; counts the attempts that started."""
    effects["slow_started"] += 1
    await asyncio.sleep(seconds)
    effects["slow"] += 1
    return "slow done"


class RequireBearer:
    """With --token: every /mcp request must carry it (as a real remote would)."""

    def __init__(self, app, token: str | None) -> None:
        self.app, self.token = app, token

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and (traceparent := dict(scope["headers"]).get(b"traceparent")):
            traceparents.append(traceparent.decode())
        if self.token and scope["type"] == "http":
            given = dict(scope["headers"]).get(b"authorization", b"").decode()
            if given != f"Bearer {self.token}":
                effects["unauthorized"] += 1
                return await JSONResponse({"error": "unauthorized"}, status_code=401)(scope, receive, send)
        await self.app(scope, receive, send)


async def stats(request) -> JSONResponse:
    return JSONResponse(
        {"effects": dict(effects), "tasks": len(tasks), "polls": dict(polls), "traceparents": traceparents}
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--token", help="require this bearer token on /mcp")
    options = parser.parse_args()
    port = options.port
    mcp_app = server.streamable_http_app(streamable_http_path="/mcp")
    app = Starlette(
        routes=[Route("/stats", stats), Mount("/", app=RequireBearer(mcp_app, options.token))],
        lifespan=mcp_app.router.lifespan_context,
    )
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


if __name__ == "__main__":
    main()
