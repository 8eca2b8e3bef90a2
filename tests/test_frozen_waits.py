"""The answers of /mcp that wait (subscriptions/listen, a blocking tasks/result) across a
frozen database: each ends with the JSON-RPC error a client retries (-32003, "Service
unavailable"), as its request would have been answered, never with a broken stream. They
ask the database again every stream.auth_recheck_seconds whether their key still works;
that question, asked of a frozen server, raised out of the stream after its headers were
sent, and the client saw the connection cut with no answer at all."""

from __future__ import annotations

from typing import Any

import pytest

from conftest import Persona, Processes, free_port, wait_until
from mcp_server.protocol import MODERN, SERVICE_UNAVAILABLE, TASKS_EXT
from tests.mcp_stream import PostStream
from tests.test_database_restart import (
    PrivatePostgres,
    private_postgres,  # noqa: F401 (the fixture)
    start_task,
)

pytestmark = pytest.mark.django_db(transaction=True)

META = {
    "io.modelcontextprotocol/protocolVersion": MODERN,
    "io.modelcontextprotocol/clientCapabilities": {"extensions": {TASKS_EXT: {}}},
}


def waits(base: str, persona: Persona, task_id: str) -> list[PostStream]:
    """A subscriptions/listen on the 2026 wire and a blocking tasks/result on the 2025 one."""
    listen: dict[str, Any] = {"jsonrpc": "2.0", "id": 1, "method": "subscriptions/listen"}
    listen["params"] = {"_meta": META, "notifications": {"taskIds": [task_id]}}
    blocking = {"jsonrpc": "2.0", "id": 3, "method": "tasks/result", "params": {"taskId": task_id}}
    auth = {"Authorization": f"Bearer {persona.token}", "Accept": "application/json, text/event-stream"}
    return [
        PostStream(
            f"{base}/mcp", listen, {**auth, "MCP-Protocol-Version": MODERN, "Mcp-Method": "subscriptions/listen"}
        ),
        PostStream(f"{base}/mcp", blocking, {**auth, "MCP-Protocol-Version": "2025-11-25"}),
    ]


def test_a_waiting_mcp_answer_ends_with_service_unavailable_when_the_database_freezes(
    alice,
    processes: Processes,
    private_postgres: PrivatePostgres,  # noqa: F811 (the fixture imported above)
):
    """The recheck is due at every look (0.1 s, below the looks' interval): the freeze meets it first."""
    url = private_postgres.copy_of_the_test_database()
    port = free_port()
    processes.web(port, DATABASE_URL=url, RUNTIME_DB_QUERY_SECONDS="2", STREAM_AUTH_RECHECK_SECONDS="0.1")
    base = f"http://127.0.0.1:{port}"
    task_id = start_task(base, alice)  # no worker: the answers wait
    streams = waits(base, alice, task_id)
    wait_until(lambda: streams[0].first("notifications/tasks"), timeout=20, what="the listen to start")
    wait_until(lambda: streams[1].status == 200, timeout=20, what="the blocking tasks/result to start")

    private_postgres.freeze()
    try:
        wait_until(lambda: all(s.closed for s in streams), timeout=30, what="the waiting answers to end")
    finally:
        private_postgres.thaw()
    for stream, id_ in zip(streams, (1, 3), strict=True):
        answer = stream.response()
        assert answer is not None, f"the stream of id {id_} ended with no answer: {stream.messages}"
        assert answer["id"] == id_ and answer["error"]["code"] == SERVICE_UNAVAILABLE, answer
    assert "Exception in ASGI application" not in processes.logs()
