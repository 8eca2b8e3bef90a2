"""The wire: JSON-RPC framing, the two eras, header and _meta validation, error codes.

Nothing here touches the database; mcp_server/modern.py, legacy.py and shared.py do the
work and mcp_server/views.py is the HTTP edge.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass, field
from typing import Any

from common import json_safety

MODERN = "2026-07-28"
LEGACY_VERSIONS = ("2025-11-25", "2025-06-18", "2025-03-26", "2024-11-05")
TASKS_EXT = "io.modelcontextprotocol/tasks"
META_VERSION = "io.modelcontextprotocol/protocolVersion"
META_CAPS = "io.modelcontextprotocol/clientCapabilities"
META_SERVER = "io.modelcontextprotocol/serverInfo"
RELATED_TASK = "io.modelcontextprotocol/related-task"
SERVER_INFO = {"name": "agent-runtime", "version": "0.1.0"}

PARSE_ERROR = -32700
INVALID_REQUEST = -32600
METHOD_NOT_FOUND = -32601
INVALID_PARAMS = -32602
INTERNAL_ERROR = -32603
HEADER_MISMATCH = -32020
MISSING_CAPABILITY = -32021
UNSUPPORTED_VERSION = -32022
SERVICE_UNAVAILABLE = -32003  # implementation-defined: an infrastructure fault, named; HTTP 503, Retry-After

# HTTP status per JSON-RPC code on the modern wire (as the SDK server maps them).
HTTP_STATUS = {
    PARSE_ERROR: 400,
    INVALID_REQUEST: 400,
    INVALID_PARAMS: 400,
    HEADER_MISMATCH: 400,
    MISSING_CAPABILITY: 400,
    UNSUPPORTED_VERSION: 400,
    METHOD_NOT_FOUND: 404,
    INTERNAL_ERROR: 500,
    SERVICE_UNAVAILABLE: 503,
}

# Methods whose Mcp-Name header must equal a param (modern wire).
NAME_PARAM = {
    "tools/call": "name",
    "prompts/get": "name",
    "resources/read": "uri",
    "tasks/get": "taskId",
    "tasks/update": "taskId",
    "tasks/cancel": "taskId",
}


class RpcError(Exception):
    def __init__(
        self, code: int, message: str, data: Any = None, *, http_status: int | None = None, request_id: Any = None
    ) -> None:
        super().__init__(message)
        self.code, self.message, self.data = code, message, data
        self.http_status = http_status or HTTP_STATUS.get(code, 400)
        self.request_id = request_id  # raised before a Message exists: the id it could read, if any

    def body(self, request_id: Any) -> dict[str, Any]:
        error: dict[str, Any] = {"code": self.code, "message": self.message}
        if self.data is not None:
            error["data"] = self.data
        return {"jsonrpc": "2.0", "id": request_id, "error": error}


def missing_extension(what: str) -> RpcError:
    return RpcError(
        MISSING_CAPABILITY,
        f"{what} needs the client capability extension {TASKS_EXT}",
        {"requiredCapabilities": {"extensions": {TASKS_EXT: {}}}},
    )


@dataclass
class Message:
    """One parsed JSON-RPC message and what the request says about itself."""

    id: Any
    method: str | None
    params: dict[str, Any]
    modern: bool
    is_response: bool = False
    raw: dict[str, Any] = field(default_factory=dict)
    session_id: str | None = None  # Mcp-Session-Id (2025-11-25 only; the modern wire ignores it)

    @property
    def is_notification(self) -> bool:
        return self.method is not None and "id" not in self.raw

    @property
    def meta(self) -> dict[str, Any]:
        meta = self.params.get("_meta")
        return meta if isinstance(meta, dict) else {}

    @property
    def client_capabilities(self) -> dict[str, Any]:
        caps = self.meta.get(META_CAPS)
        return caps if isinstance(caps, dict) else {}

    @property
    def has_tasks_extension(self) -> bool:
        extensions = self.client_capabilities.get("extensions")
        return isinstance(extensions, dict) and isinstance(extensions.get(TASKS_EXT), dict)


def readable_id(value: Any) -> Any:
    """A request id fit to echo in an error: a string or an integer with nothing hostile in it."""
    if not isinstance(value, str | int) or isinstance(value, bool):
        return None
    try:
        json_safety.check(value)
    except json_safety.UnsafeInput:
        return None
    return value


def request_id_of(body: bytes) -> Any:
    """The id of a request answered without being parsed (the database was down), if readable."""
    try:
        raw = json_safety.parse(body)
    except json_safety.UnsafeInput:
        return readable_id(json_safety.peek_member(body, "id"))
    return readable_id(raw.get("id")) if isinstance(raw, dict) else None


def parse(body: bytes, headers: dict[str, str]) -> Message:
    """Decode one JSON-RPC message and pick its era. RpcError on anything malformed or
    hostile (common.json_safety), carrying the request's id whenever it can be read."""
    try:
        raw = json_safety.parse(body)
    except json_safety.NotJson as exc:
        raise RpcError(PARSE_ERROR, f"Parse error: {exc}") from None
    except json_safety.UnsafeInput as exc:  # too deep to parse, but its id may still be read
        raise RpcError(
            INVALID_REQUEST, f"Invalid Request: {exc}", request_id=readable_id(json_safety.peek_member(body, "id"))
        ) from None
    if isinstance(raw, list):
        raise RpcError(INVALID_REQUEST, "Invalid Request: batches are not supported")
    echo = readable_id(raw.get("id")) if isinstance(raw, dict) else None
    if not isinstance(raw, dict) or raw.get("jsonrpc") != "2.0":
        raise RpcError(INVALID_REQUEST, "Invalid Request: not a JSON-RPC 2.0 object", request_id=echo)
    request_id = raw.get("id")
    if "id" in raw and (isinstance(request_id, bool) or not isinstance(request_id, str | int)):
        raise RpcError(INVALID_REQUEST, "Invalid Request: id must be a string or an integer")
    try:
        json_safety.check(raw)
    except json_safety.UnsafeInput as exc:
        if exc.where.startswith("params"):
            raise RpcError(INVALID_PARAMS, f"Invalid params: {exc}", request_id=echo) from None
        raise RpcError(INVALID_REQUEST, f"Invalid Request: {exc}", request_id=echo) from None
    params = raw.get("params", {})
    if params is None:
        params = {}
    if "method" not in raw:
        if "id" in raw and ("result" in raw or "error" in raw):  # a client's answer to a server request
            return Message(
                request_id,
                None,
                {},
                modern=False,
                is_response=True,
                raw=raw,
                session_id=headers.get("mcp-session-id") or None,
            )
        raise RpcError(INVALID_REQUEST, "Invalid Request: no method", request_id=echo)
    if not isinstance(raw["method"], str) or not raw["method"]:
        raise RpcError(INVALID_REQUEST, "Invalid Request: method must be a non-empty string", request_id=echo)
    if not isinstance(params, dict):
        raise RpcError(INVALID_PARAMS, "Invalid params: params must be an object", request_id=echo)
    header_version = headers.get("mcp-protocol-version", "").strip()
    meta = params.get("_meta")
    meta_version = meta.get(META_VERSION) if isinstance(meta, dict) else None
    # The modern wire announces itself per request: its header or its _meta. Everything
    # else (no header, or a pre-2026 header) is the 2025-11-25 handshake era.
    modern = meta_version is not None or (header_version != "" and header_version not in LEGACY_VERSIONS)
    session_id = None if modern else (headers.get("mcp-session-id") or None)
    return Message(request_id, raw["method"], params, modern=modern, raw=raw, session_id=session_id)


def decode_header(value: str) -> str:
    """Header values that are not header-safe travel as =?base64?...?=."""
    value = value.strip()
    if value.startswith("=?base64?") and value.endswith("?="):
        try:
            return base64.b64decode(value[len("=?base64?") : -2], validate=True).decode()
        except (binascii.Error, UnicodeDecodeError):
            raise RpcError(HEADER_MISMATCH, "Header mismatch: undecodable base64 header value") from None
    return value


def validate_modern(message: Message, headers: dict[str, str]) -> None:
    """Headers first (a header that disagrees with the body is -32020 even when the
    body's version is nonsense), then the required _meta, then the version."""
    header_version = headers.get("mcp-protocol-version", "").strip()
    meta = message.params.get("_meta")
    if not header_version:
        raise RpcError(HEADER_MISMATCH, "Header mismatch: MCP-Protocol-Version header is required")
    if isinstance(meta, dict) and META_VERSION in meta and not isinstance(meta[META_VERSION], str):
        # The body's shape, not a header's disagreement with it (no header value is a number).
        raise RpcError(INVALID_PARAMS, f"Invalid params: _meta.{META_VERSION} must be a string")
    if isinstance(meta, dict) and META_VERSION in meta and meta[META_VERSION] != header_version:
        raise RpcError(
            HEADER_MISMATCH,
            "Header mismatch: MCP-Protocol-Version does not match _meta.io.modelcontextprotocol/protocolVersion",
        )
    method_header = headers.get("mcp-method")
    if method_header is None or decode_header(method_header) != message.method:
        raise RpcError(HEADER_MISMATCH, f"Header mismatch: Mcp-Method must be {message.method!r}")
    if (param := NAME_PARAM.get(message.method or "")) is not None:
        name_header, value = headers.get("mcp-name"), message.params.get(param)
        if name_header is None or not isinstance(value, str) or decode_header(name_header) != value:
            raise RpcError(HEADER_MISMATCH, f"Header mismatch: Mcp-Name must equal params.{param}")
    if not isinstance(meta, dict):
        raise RpcError(INVALID_PARAMS, "Invalid params: _meta is required")
    missing = [key for key in (META_VERSION, META_CAPS) if key not in meta]
    if missing:
        raise RpcError(INVALID_PARAMS, f"Invalid params: missing _meta keys: {', '.join(missing)}")
    if not isinstance(meta[META_CAPS], dict):
        raise RpcError(INVALID_PARAMS, "Invalid params: clientCapabilities must be an object")
    if meta[META_VERSION] != MODERN:
        raise RpcError(
            UNSUPPORTED_VERSION,
            "Unsupported protocol version",
            {"supported": [MODERN], "requested": str(meta[META_VERSION])},
        )


def result_body(request_id: Any, result: dict[str, Any]) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": request_id, "result": result}
