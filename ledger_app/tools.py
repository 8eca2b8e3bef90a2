"""Registered tools (DESIGN §6). A tool call with an external effect only ever happens
through ledger_app.actions.execute_once, which commits a ledger row first and passes the
row's key to the remote as its idempotency key."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx
from django.conf import settings


class ToolError(Exception):
    def __init__(self, message: str, *, retryable: bool) -> None:
        super().__init__(message)
        self.retryable = retryable


# What a reconcile hook may answer about a call made by an earlier run.
DONE, NOT_DONE = "done", "not_done"


@dataclass(frozen=True)
class Tool:
    name: str
    input_schema: dict[str, Any]
    call: Callable[[dict[str, Any], str, float], Any]  # (args, idempotency key, timeout) -> result
    side_effect: bool = True
    timeout: float = 10.0
    retries: int = 2  # after the first attempt; bounded
    backoff: float = 0.2  # seconds, doubled per retry
    # (args, key) -> (DONE, result) | (NOT_DONE, None); None (or the hook raising) means it cannot tell
    reconcile: Callable[[dict[str, Any], str], tuple[str, Any] | None] | None = None


_TOOLS: dict[str, Tool] = {}


class UnknownTool(LookupError):
    pass


def register(tool: Tool) -> Tool:
    _TOOLS[tool.name] = tool
    return tool


def get_tool(name: str) -> Tool:
    try:
        return _TOOLS[name]
    except KeyError:
        raise UnknownTool(f"no tool named {name!r}") from None


# --- http.request -------------------------------------------------------------------------

def _allowed(url: str) -> None:
    host = (urlsplit(url).hostname or "").lower()
    allow = [h.lower() for h in settings.RUNTIME["security"].get("http_allowlist", [])]
    if not any(host == a or host.endswith("." + a) for a in allow):
        raise ToolError(f"host {host!r} is not in security.http_allowlist", retryable=False)


def _http_call(args: dict[str, Any], key: str, timeout: float) -> Any:
    _allowed(args["url"])
    try:
        response = httpx.request(args.get("method", "POST"), args["url"], json=args.get("json"),
                                 headers={"Idempotency-Key": key}, timeout=timeout)
    except httpx.TimeoutException as exc:
        raise ToolError(f"timed out after {timeout}s: {exc}", retryable=True) from exc
    except httpx.TransportError as exc:
        raise ToolError(f"transport error: {exc}", retryable=True) from exc
    if response.status_code >= 500 or response.status_code == 429:
        raise ToolError(f"HTTP {response.status_code} from {args['url']}", retryable=True)
    if response.status_code >= 400:
        raise ToolError(f"HTTP {response.status_code} from {args['url']}: {response.text[:200]}", retryable=False)
    try:
        body: Any = response.json()
    except ValueError:
        body = response.text[:2000]
    return {"status": response.status_code, "body": body}


def _http_reconcile(args: dict[str, Any], key: str) -> tuple[str, Any] | None:
    """Ask the remote by key, where the caller told us how (args.reconcileUrl)."""
    if not args.get("reconcileUrl"):
        return None
    url = args["reconcileUrl"].replace("{key}", key)
    _allowed(url)
    response = httpx.get(url, headers={"Idempotency-Key": key}, timeout=10)
    if response.status_code == 404:
        return NOT_DONE, None
    if response.status_code == 200:
        return DONE, {"status": 200, "body": response.json(), "reconciled": True}
    return None


register(Tool(
    name="http.request",
    input_schema={
        "type": "object",
        "properties": {
            "method": {"enum": ["POST", "PUT", "PATCH", "DELETE"]},
            "url": {"type": "string", "pattern": "^https?://"},
            "json": {},
            "reconcileUrl": {"type": "string", "pattern": "^https?://"},
        },
        "required": ["url"],
        "additionalProperties": False,
    },
    call=_http_call,
    reconcile=_http_reconcile,
))
