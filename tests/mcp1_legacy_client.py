"""Run by tests/test_mcp_legacy.py in .venv-mcp1 (mcp 1.x): the 2025-11-25 experimental
task client against /mcp. Prints one JSON object with what it saw; asserts nothing itself."""

from __future__ import annotations

import asyncio
import json
import sys
import warnings

from mcp import ClientSession
from mcp.client.streamable_http import streamablehttp_client
from mcp.shared.exceptions import McpError
from mcp.types import CallToolResult

warnings.simplefilter("ignore", DeprecationWarning)


async def main(url: str, token: str) -> dict:
    seen: dict = {}
    async with (
        streamablehttp_client(url, headers={"Authorization": f"Bearer {token}"}) as (read, write, _),
        ClientSession(read, write) as s,
    ):
        init = await s.initialize()
        seen["protocolVersion"] = init.protocolVersion
        seen["tasksCapability"] = init.capabilities.model_dump(exclude_none=True).get("tasks")
        tools = (await s.list_tools()).tools
        seen["taskSupport"] = {t.name: t.execution.taskSupport if t.execution else None for t in tools}
        created = await s.experimental.call_tool_as_task("slow_compute", {"seconds": 1, "label": "legacy"}, ttl=60000)
        tid = created.task.taskId
        seen["created"] = created.task.model_dump(mode="json")
        seen["statuses"] = [st.status async for st in s.experimental.poll_task(tid)]
        final = await s.experimental.get_task_result(tid, CallToolResult)
        seen["result"] = final.model_dump(mode="json", by_alias=True)
        listed = await s.experimental.list_tasks()
        seen["listed"] = [t.taskId for t in listed.tasks]
        long = await s.experimental.call_tool_as_task("slow_compute", {"seconds": 60}, ttl=60000)
        cancelled = await s.experimental.cancel_task(long.task.taskId)
        seen["cancelId"] = long.task.taskId
        seen["cancelled"] = cancelled.status
        try:
            await s.experimental.cancel_task(long.task.taskId)
            seen["cancelAgain"] = "no error"
        except McpError as exc:
            seen["cancelAgain"] = exc.error.code
        failing = await s.experimental.call_tool_as_task("failing_job", {}, ttl=60000)
        seen["failingStatuses"] = [st.status async for st in s.experimental.poll_task(failing.task.taskId)]
        try:
            await s.experimental.get_task("00000000-0000-4000-8000-000000000000")
            seen["unknown"] = "no error"
        except McpError as exc:
            seen["unknown"] = exc.error.code
        greeting = await s.call_tool("greet", {"name": "legacy"})
        seen["greet"] = greeting.content[0].text
    return seen


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(sys.argv[1], sys.argv[2]))))
