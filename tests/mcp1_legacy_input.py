"""Run by tests/test_mcp_legacy.py in .venv-mcp1 (mcp 1.x): the 2025-11-25 input flow. The
server asks on the tasks/result stream (elicitation/create); the SDK's elicitation_callback
answers, and the SDK POSTs the answer. Prints one JSON object with what it saw."""

from __future__ import annotations

import asyncio
import json
import sys
import warnings
from typing import Any

import httpx
from mcp import ClientSession
from mcp.client.streamable_http import streamablehttp_client
from mcp.types import CallToolResult, ElicitRequestParams, ElicitResult, ErrorData, JSONRPCError, JSONRPCResponse

warnings.simplefilter("ignore", DeprecationWarning)
RELATED = "io.modelcontextprotocol/related-task"


class ResponseTap:
    """The session's write stream, counting responses once the transport has taken them. The
    transport POSTs a response before it takes the next message, so a request sent after
    that is POSTed only once the server has answered the response's POST."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.responses, self.changed = inner, 0, asyncio.Event()

    async def send(self, message: Any) -> None:
        await self.inner.send(message)
        if isinstance(message.message.root, JSONRPCResponse | JSONRPCError):
            self.responses += 1
            self.changed.set()

    async def until(self, responses: int) -> None:
        while self.responses < responses:
            self.changed.clear()
            await self.changed.wait()

    async def __aenter__(self) -> ResponseTap:
        await self.inner.__aenter__()
        return self

    async def __aexit__(self, *exc: Any) -> Any:
        return await self.inner.__aexit__(*exc)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def text(result: CallToolResult) -> str:
    return result.content[0].text


async def session_run(url: str, token: str, answer, body) -> Any:
    asked: list[dict] = []

    async def callback(ctx: Any, params: ElicitRequestParams) -> ElicitResult | ErrorData:
        asked.append(
            {
                "message": params.message,
                "related": (params.meta.model_extra or {}).get(RELATED) if params.meta else None,
                "schema": params.requestedSchema,
            }
        )
        return answer(params)

    headers = {"Authorization": f"Bearer {token}"}
    async with streamablehttp_client(url, headers=headers) as (read, write, session_id):
        tap = ResponseTap(write)
        async with ClientSession(read, tap, elicitation_callback=callback) as s:
            await s.initialize()
            return await body(s, tap, asked, session_id())


def accept(values: dict[str, bool]):
    def answer(params: ElicitRequestParams) -> ElicitResult:
        which = (
            "first"
            if params.message.startswith("First")
            else "second"
            if params.message.startswith("Second")
            else "confirm"
        )
        return ElicitResult(action="accept", content={"confirm": values[which]})

    return answer


async def main(url: str, token: str) -> dict:
    seen: dict = {}

    async def confirm(s: ClientSession, tap: ResponseTap, asked: list, session_id: str | None) -> None:
        created = await s.experimental.call_tool_as_task("confirm_delete", {"filename": "a.txt"}, ttl=60000)
        final = await s.experimental.get_task_result(created.task.taskId, CallToolResult)
        seen["confirm"] = {
            "taskId": created.task.taskId,
            "asked": asked,
            "text": text(final),
            "meta": final.meta,
            "sessionId": session_id,
        }

    await session_run(url, token, accept({"confirm": True}), confirm)

    async def multi(s: ClientSession, tap: ResponseTap, asked: list, session_id: str | None) -> None:
        created = await s.experimental.call_tool_as_task("multi_input", {}, ttl=60000)
        final = await s.experimental.get_task_result(created.task.taskId, CallToolResult)
        seen["multi"] = {"taskId": created.task.taskId, "asked": [a["message"] for a in asked], "text": text(final)}

    await session_run(url, token, accept({"first": True, "second": False}), multi)

    async def decline(s: ClientSession, tap: ResponseTap, asked: list, session_id: str | None) -> None:
        created = await s.experimental.call_tool_as_task("confirm_delete", {"filename": "b.txt"}, ttl=60000)
        tid = created.task.taskId
        waiting = asyncio.create_task(s.experimental.get_task_result(tid, CallToolResult))
        await asyncio.wait_for(tap.until(1), timeout=60)  # the decline has been POSTed and answered
        after = await s.experimental.get_task(tid)
        # Someone answers elsewhere (REST); the waiting tasks/result then returns.
        async with httpx.AsyncClient(headers={"Authorization": f"Bearer {token}"}) as rest:
            posted = await rest.post(
                url.removesuffix("/mcp") + f"/runtime/tasks/{tid}/inputs/confirm", json={"answer": {"confirm": True}}
            )
        final = await asyncio.wait_for(waiting, timeout=60)
        seen["decline"] = {
            "taskId": tid,
            "asked": len(asked),
            "statusAfterDecline": after.status,
            "rest": posted.status_code,
            "text": text(final),
        }

    await session_run(url, token, lambda params: ElicitResult(action="decline"), decline)
    return seen


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(sys.argv[1], sys.argv[2])), default=str))
