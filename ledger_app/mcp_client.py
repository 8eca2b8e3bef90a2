"""The remote MCP tool's wire, through the official SDK (`mcp` 2.3.0, the 2026-07-28 wire).

We declare the io.modelcontextprotocol/tasks extension on every request, so a remote may
answer a tools/call with a task of its own. The caller (ledger_app.tools) stores that task
id in the ledger and polls it with tasks/get: in this slice, the next one, or after a
restart — never by calling the tool again. The SDK is async; workers are not, so each
exchange runs in its own short event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal

import httpx2
from mcp import Client, types
from mcp.client import ClaimContext, ClientExtension, ResultClaim
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError
from mcp_types import REQUEST_TIMEOUT
from pydantic import TypeAdapter

from tasks_app import leases
from tasks_app.redaction import tool_text

TASKS = "io.modelcontextprotocol/tasks"
TERMINAL = ("completed", "failed", "cancelled")
# Our key travels in the request's _meta, so a remote that de-duplicates can use it.
IDEMPOTENCY_META = "io.github.agent-runtime/idempotency-key"
_RAW = TypeAdapter(dict[str, Any])


class RemoteError(Exception):
    def __init__(self, message: str, *, retryable: bool) -> None:
        super().__init__(message)
        self.retryable = retryable


@dataclass(frozen=True)
class RemoteTask:
    """The remote took the call as a task: poll `task_id` until it ends."""

    task_id: str
    status: str
    message: str
    poll_interval_ms: int | None


class _TaskIdParams(types.RequestParams):
    task_id: str


class _GetTask(types.Request[_TaskIdParams, Literal["tasks/get"]]):
    method: Literal["tasks/get"] = "tasks/get"
    params: _TaskIdParams
    name_param = "taskId"  # sent as the Mcp-Name header, as the extension asks


class _CreateTaskResult(types.Result):
    result_type: Literal["task"] = "task"
    task_id: str
    status: str
    status_message: str | None = None
    created_at: str
    last_updated_at: str
    ttl_ms: int | None
    poll_interval_ms: int | None = None


class _Tasks(ClientExtension):
    """Declares the extension and claims its CreateTaskResult; we resolve it ourselves
    (session.call_tool(..., allow_claimed=True)), so the resolver is never used."""

    identifier = TASKS

    def claims(self) -> list[ResultClaim[Any]]:
        return [ResultClaim(result_type="task", model=_CreateTaskResult, resolve=self._resolve)]

    async def _resolve(self, created: _CreateTaskResult, ctx: ClaimContext) -> types.CallToolResult:
        raise NotImplementedError("the ledger polls remote tasks itself")


def call_tool(
    server: str,
    tool: str,
    arguments: dict[str, Any],
    *,
    key: str,
    timeout: float,
    headers: dict[str, str] | None = None,
) -> dict[str, Any] | RemoteTask:
    """One tools/call: the tool's result (a CallToolResult as JSON), or the remote task."""

    async def go(client: Client) -> dict[str, Any] | RemoteTask:
        # mypy reads no PEP 728 extra_items, so it takes the SDK's open RequestParamsMeta as closed.
        result = await client.session.call_tool(  # type: ignore[call-overload]
            tool, arguments, read_timeout_seconds=timeout, meta={IDEMPOTENCY_META: key}, allow_claimed=True
        )
        if isinstance(result, _CreateTaskResult):
            return RemoteTask(result.task_id, result.status, result.status_message or "", result.poll_interval_ms)
        return _tool_result(tool, result.model_dump(mode="json", by_alias=True, exclude_none=True))

    return _run(server, timeout, headers, go)


def list_tools(server: str, *, timeout: float, headers: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """tools/list (every page): the server's tools as JSON (name, description, inputSchema). A read."""

    async def go(client: Client) -> list[dict[str, Any]]:
        found: list[dict[str, Any]] = []
        cursor = None
        while True:
            params = types.PaginatedRequestParams(cursor=cursor) if cursor else None
            page = await client.session.list_tools(params=params)
            found += [t.model_dump(mode="json", by_alias=True, exclude_none=True) for t in page.tools]
            if not (cursor := page.next_cursor) or len(found) > 1000:
                return found

    return _run(server, timeout, headers, go)


def get_task(
    server: str, task_id: str, *, timeout: float, headers: dict[str, str] | None = None
) -> dict[str, Any] | RemoteTask:
    """tasks/get: the final tool result once the remote task completed, else its state."""

    async def go(client: Client) -> dict[str, Any] | RemoteTask:
        # The SDK bounds the result type to BaseModel, yet validates with any TypeAdapter: we want the raw dict.
        task = await client.session.send_request(  # type: ignore[type-var]
            _GetTask(params=_TaskIdParams(task_id=task_id)), _RAW, request_read_timeout_seconds=timeout
        )
        status = task.get("status")
        if status == "completed":
            return _tool_result(f"remote task {task_id}", task.get("result") or {})
        if status == "failed":
            error = task.get("error") or {}
            raise RemoteError(
                f"remote task {task_id} failed: {error.get('message') or task.get('statusMessage')}"
                f" (code {error.get('code')})",
                retryable=False,
            )
        if status == "cancelled":
            raise RemoteError(f"remote task {task_id} was cancelled by the remote", retryable=False)
        return RemoteTask(task_id, str(status), task.get("statusMessage") or "", task.get("pollIntervalMs"))

    return _run(server, timeout, headers, go)


def _tool_result(what: str, result: dict[str, Any]) -> dict[str, Any]:
    if result.get("isError"):
        text = " ".join(c.get("text", "") for c in result.get("content", []) if c.get("type") == "text")
        raise RemoteError(f"{what} answered with an error: {tool_text(text, limit=500)}", retryable=False)
    result.pop("_meta", None)
    result.pop("resultType", None)
    return result


@functools.cache
def _tls() -> ssl.SSLContext:
    """Built once: making the default TLS context is most of a new client's cost (~20 ms)."""
    return ssl.create_default_context()


def warm() -> None:
    """Pay the client's one-time costs now; workers call this before their pool forks.

    Paid lazily, they fell in the first call of every new pool process, while its slice
    held a lease: importing this module and the SDK is ~0.9 s of CPU, the TLS context ~70 ms
    in one C call, the transport and anyio's backend ~0.1 s more, all of it holding the GIL
    that the lease's heartbeat thread needs for every renewal. On a CPU-starved worker that
    stretched to a minute with renewals seconds late, and the lease was lost mid-call
    (issue 12 #4, measured). After this, a call costs ~10 ms of CPU."""
    import anyio
    import httpcore2  # noqa: F401 (httpx2 imports its transport on first use)

    _tls()
    anyio.run(anyio.sleep, 0, backend="asyncio")  # loads anyio's asyncio backend


def _run[T](server: str, timeout: float, headers: dict[str, str] | None, go: Callable[[Client], Awaitable[T]]) -> T:
    refused: list[int] = []  # the SDK reports an HTTP 401 as a generic error; we need to tell
    lost: list[leases.LeaseLost] = []  # ... and whatever it makes of a request we did not send
    called: list[bool] = []  # the tools/call went out

    async def still_ours(request: httpx2.Request) -> None:
        """Right before each request up to the tools/call goes out (the SDK's tasks copy this
        thread's context, so the lease confirmed for a call is seen here): a worker frozen
        since, and thawed after another took the task over, sends nothing
        (leases.still_confirmed, as http.request's client). Not after it: what follows (the
        session's end, after a call that may have run for several leases while the
        heartbeat renewed ours) changes nothing at the remote."""
        if called:
            return
        try:
            leases.still_confirmed()
        except leases.LeaseLost as exc:
            lost.append(exc)
            raise
        with contextlib.suppress(httpx2.RequestNotRead):  # a streamed body: not the SDK's JSON-RPC
            if b'"tools/call"' in request.content:
                called.append(True)

    async def seen(response: httpx2.Response) -> None:
        if response.status_code in (401, 403, 404):
            refused.append(response.status_code)

    async def session() -> T:
        http = httpx2.AsyncClient(
            headers=headers or {},
            event_hooks={"request": [still_ours], "response": [seen]},
            verify=_tls(),
            timeout=httpx2.Timeout(30.0, connect=min(timeout, 30.0), read=300.0),
        )
        transport = streamable_http_client(server, http_client=http)
        async with (
            http,
            Client(
                transport, mode="2026-07-28", extensions=[_Tasks()], read_timeout_seconds=timeout, cache=None
            ) as client,
        ):
            return await go(client)

    try:
        return asyncio.run(session())
    except BaseException as exc:  # the SDK's task groups wrap what went wrong
        if lost:
            raise lost[0] from exc  # not a remote's error: the slice gives the task up, unsent
        raise _classify(exc, refused) from exc


def _classify(exc: BaseException, refused: list[int]) -> BaseException:
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    if isinstance(exc, RemoteError):
        return exc
    generic = not isinstance(exc, MCPError) or exc.code == -32603  # what the SDK makes of an HTTP error
    if refused and generic and isinstance(exc, Exception):
        what = {401: "refused our credentials", 403: "forbids this call", 404: "has no MCP endpoint there"}
        return RemoteError(f"the server {what[refused[-1]]} (HTTP {refused[-1]})", retryable=False)
    if isinstance(exc, MCPError):
        if exc.code == REQUEST_TIMEOUT:
            return RemoteError(f"timed out: {exc.message}", retryable=True)
        # -32602 (unknown task: expired or never ours), -32601, -32600: asking again will not help
        retryable = exc.code in (-32603, -32000)
        return RemoteError(f"JSON-RPC error {exc.code}: {exc.message}", retryable=retryable)
    if isinstance(exc, (httpx2.TransportError, TimeoutError, ConnectionError, OSError)):
        return RemoteError(f"transport error: {type(exc).__name__}: {exc}", retryable=True)
    if isinstance(exc, Exception):
        return RemoteError(f"{type(exc).__name__}: {exc}", retryable=False)
    return exc  # KeyboardInterrupt, SystemExit: not ours to translate
