"""The 2025-11-25 input flow: a client waiting on tasks/result is asked the task's open
questions as elicitation/create *requests* on that stream, and answers by POSTing a
JSON-RPC response (MCP-TASKS.md §2, docs/mcp.md).

Nothing here lives in process memory across requests: the stream and the POSTed answer
may be served by different web workers. The request id carries the task and the input
key, signed with SECRET_KEY and salted with the asking principal (tenant and actor), so
only the principal that was asked can answer, and nobody can forge an id for a question.
The client's capabilities from `initialize` travel the same way, in a signed
Mcp-Session-Id: the server asks only clients that declared elicitation.
"""

from __future__ import annotations

import secrets
from typing import Any
from uuid import UUID

from django.core import signing

from mcp_server.protocol import RELATED_TASK
from tasks_app.auth import Principal

ID_PREFIX = "rt-input:"
_INPUT_SALT = "tasks_app.mcp.elicit.input"
_SESSION_SALT = "tasks_app.mcp.elicit.session"


def _salt(base: str, who: Principal) -> str:
    return f"{base}:{who.tenant.pk}:{who.actor}"


def mint_session(who: Principal, client_capabilities: Any) -> str:
    """A session id for the initialize answer: what the client declared, bound to `who`."""
    caps = client_capabilities if isinstance(client_capabilities, dict) else {}
    elicitation = caps.get("elicitation")
    # 2025-11-25: an empty elicitation object means form mode (backwards compatibility).
    form = isinstance(elicitation, dict) and ("form" in elicitation or "url" not in elicitation)
    return signing.dumps({"form": form}, salt=_salt(_SESSION_SALT, who))


def asks_forms(who: Principal, session_id: str | None) -> bool:
    """True when the session was minted for `who` and its client declared form elicitation.
    No session, or one minted for someone else: the client is never sent requests."""
    if not session_id:
        return False
    try:
        caps = signing.loads(session_id, salt=_salt(_SESSION_SALT, who))
    except signing.BadSignature:
        return False
    return isinstance(caps, dict) and caps.get("form") is True


def request_id(who: Principal, task_id: UUID, key: str) -> str:
    """A fresh JSON-RPC id for asking `who` the question `key` of the task (a nonce keeps
    ids unique when the same question is asked on a later stream)."""
    return ID_PREFIX + signing.dumps([str(task_id), key, secrets.token_hex(4)], salt=_salt(_INPUT_SALT, who))


def read_request_id(who: Principal, raw: Any) -> tuple[UUID, str] | None:
    """(task id, key) from an id this server gave `who`; None for anything else."""
    if not isinstance(raw, str) or not raw.startswith(ID_PREFIX):
        return None
    try:
        task_id, key, _ = signing.loads(raw.removeprefix(ID_PREFIX), salt=_salt(_INPUT_SALT, who))
        return UUID(task_id), str(key)
    except (signing.BadSignature, ValueError, TypeError):
        return None


def elicitation_requests(
    who: Principal, task_id: UUID, open_requests: dict[str, Any], asked: set[str]
) -> list[dict[str, Any]]:
    """JSON-RPC requests for the open questions not yet asked on this stream (`asked` is
    the stream's own memory: a declined question is not asked again on the same stream)."""
    out = []
    for key, embedded in open_requests.items():
        if key in asked:
            continue
        asked.add(key)
        params = {**embedded["params"], "_meta": {RELATED_TASK: {"taskId": str(task_id)}}}
        out.append(
            {"jsonrpc": "2.0", "id": request_id(who, task_id, key), "method": embedded["method"], "params": params}
        )
    return out
