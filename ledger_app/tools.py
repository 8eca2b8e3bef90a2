"""The built-in tools (DESIGN §6), registered in tasks_app.agents.tools. A tool call with an
external effect only ever happens through ledger_app.actions.execute_once, which commits a
ledger row first and passes the row's key to the remote as its idempotency key."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import replace
from typing import Any
from urllib.parse import urlsplit

import httpx
from django.conf import settings

from runtime_site.tracing import trace_headers
from tasks_app import artifacts, leases, telemetry
from tasks_app.agents import tools as registry
from tasks_app.agents.tools import DONE, NOT_DONE, Pending, Tool, ToolError, retry_after
from tasks_app.redaction import tool_text

# A tool's call asks the confirmed lease through the SDK (tools.before_send) as the built-in
# clients below ask it directly.
registry.guard_sends(leases.still_confirmed)


def register(tool: Tool) -> Tool:
    # Every call and poll is observed (metrics, a span, traceparent on the wire): tasks_app/telemetry.py.
    return registry.register(
        replace(
            tool,
            call=telemetry.tool(tool.name, tool.call),
            poll=telemetry.tool(tool.name, tool.poll) if tool.poll else None,
        )
    )


# --- http.request -------------------------------------------------------------------------


def _allowed(url: str) -> None:
    host = (urlsplit(url).hostname or "").lower()
    allow = [h.lower() for h in settings.RUNTIME["security"].get("http_allowlist", [])]
    if not any(host == a or host.endswith("." + a) for a in allow):
        raise ToolError(f"host {host!r} is not in security.http_allowlist", retryable=False)


def _check_url(url: str, field: str) -> None:
    """A URL the call can send as it was written: httpx percent-encodes
    a space and sends it, a line break or a tab is an error of its own (a step failure that
    left the call's row started), and a port past 65535 only fails as the call goes out."""
    if any(ch.isspace() or not ch.isprintable() for ch in url):
        raise ToolError(f"{field} {url[:200]!r} has a space or a control character", retryable=False)
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 (raises on a port that cannot be)
        httpx.URL(url)
    except (ValueError, httpx.InvalidURL) as exc:
        raise ToolError(f"{field} {url[:200]!r} is not a valid URL: {exc}", retryable=False) from None
    if parts.scheme.lower() not in ("http", "https") or not parts.hostname:
        raise ToolError(f"{field} {url[:200]!r} is not an http(s) URL with a host", retryable=False)


def _http_check(args: dict[str, Any], key: str) -> None:
    _check_url(args["url"], "url")
    if args.get("reconcileUrl"):
        _check_url(args["reconcileUrl"].replace("{key}", key), "reconcileUrl")


_clients: dict[int, httpx.Client] = {}


def _http() -> httpx.Client:
    """One pooled client per process (made after the worker forks): httpx.request() would
    build a client, and its TLS context, for every call — most of a local call's time."""
    pid = os.getpid()
    if pid not in _clients:
        _clients.clear()
        _clients[pid] = httpx.Client(event_hooks={"request": [_lease_still_ours]})
    return _clients[pid]


def _lease_still_ours(request: httpx.Request) -> None:
    """Right before a request goes out: a worker frozen since its lease was confirmed for
    the call, and thawed after another took the task over, sends nothing."""
    leases.still_confirmed()


def _http_call(args: dict[str, Any], key: str, timeout: float) -> Any:
    # The URL's shape was checked before the call was recorded (_http_check); its host is
    # asked here, as the call goes out: a host off the allowlist is the policy's answer to a
    # well-formed call, which an approver may already have been asked about.
    _allowed(args["url"])
    try:
        timeout = args.get("timeoutSeconds", timeout)
        response = _http().request(
            args.get("method", "POST"),
            args["url"],
            json=args.get("json"),
            headers={"Idempotency-Key": key},
            timeout=timeout,
        )
    except httpx.TimeoutException as exc:
        raise ToolError(f"timed out after {timeout}s: {exc}", retryable=True) from exc
    except httpx.TransportError as exc:
        raise ToolError(f"transport error: {exc}", retryable=True) from exc
    if response.status_code >= 500 or response.status_code == 429:
        raise ToolError(
            f"HTTP {response.status_code} from {args['url']}", retryable=True, retry_after=retry_after(response.headers)
        )
    if response.status_code >= 400:
        raise ToolError(f"HTTP {response.status_code} from {args['url']}: {response.text[:4000]}", retryable=False)
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
    response = _http().get(url, headers={"Idempotency-Key": key}, timeout=10)
    if response.status_code == 404:
        return NOT_DONE, None
    if response.status_code == 200:
        return DONE, {"status": 200, "body": response.json(), "reconciled": True}
    return None


register(
    Tool(
        name="http.request",
        input_schema={
            "type": "object",
            "properties": {
                "method": {"enum": ["POST", "PUT", "PATCH", "DELETE"]},
                "url": {"type": "string", "pattern": "^https?://"},
                "json": {},
                "reconcileUrl": {"type": "string", "pattern": "^https?://"},
                # per call, as mcp.call's: the caller knows how long the remote takes to answer
                "timeoutSeconds": {"type": "number", "exclusiveMinimum": 0, "maximum": 600},
            },
            "required": ["url"],
            "additionalProperties": False,
        },
        call=_http_call,
        check=_http_check,
        reconcile=_http_reconcile,
    )
)


# --- content.publish: copy an artifact to the published area of the blob store ----------


def _published_key(args: dict[str, Any], key: str) -> str:
    return f"published/{key.split(':', maxsplit=1)[0]}/{args['name']}"


def _publish_source(args: dict[str, Any], key: str) -> str:
    """The blob store key of the artifact to publish, which must be the calling task's own
    (its id leads the call's key): a key names any blob in the store, another task's or
    another tenant's too, and a ".." walks out of any prefix."""
    from runtime_site.blobstore import blob_store

    store = blob_store()
    source = args["source"].split("://", 1)[-1]
    if source.startswith(getattr(store, "bucket", "\0") + "/"):
        source = source.split("/", 1)[1]
    own = artifacts.prefix_of(key.split(":", maxsplit=1)[0])
    if not source.startswith(own) or any(part in ("", ".", "..") for part in source.split("/")):
        raise ToolError(f"source {args['source'][:300]!r} is not this task's own artifact ({own}...)", retryable=False)
    return source


def _publish_check(args: dict[str, Any], key: str) -> None:
    _publish_source(args, key)


def _publish_call(args: dict[str, Any], key: str, timeout: float) -> Any:
    from runtime_site.blobstore import BlobNotFound, blob_store

    store = blob_store()
    try:
        data = store.get(_publish_source(args, key))
    except BlobNotFound as exc:
        raise ToolError(f"nothing to publish at {args['source']}", retryable=False) from exc
    return {"ref": store.put(_published_key(args, key), data, args.get("contentType", "application/octet-stream"))}


def _publish_reconcile(args: dict[str, Any], key: str) -> tuple[str, Any] | None:
    from runtime_site.blobstore import blob_store

    store = blob_store()
    target = _published_key(args, key)
    return (DONE, {"ref": store.ref(target), "reconciled": True}) if store.exists(target) else (NOT_DONE, None)


register(
    Tool(
        name="content.publish",
        input_schema={
            "type": "object",
            "properties": {
                "source": {"type": "string"},
                "name": {"type": "string", "pattern": "^[A-Za-z0-9._-]+$"},
                "contentType": {"type": "string"},
            },
            "required": ["source", "name"],
            "additionalProperties": False,
        },
        call=_publish_call,
        check=_publish_check,
        reconcile=_publish_reconcile,
    )
)


# --- email.send: Django's mail backends (SMTP in production) ------------------------------


def _mail_check(args: dict[str, Any], key: str) -> None:
    """Header injection: a subject or an address with a line break would write headers of its
    own (a Bcc to anyone). Django refuses it only as the message is rendered, inside the call:
    a step failure that left the call's row started. Refused before anything is recorded."""
    from django.core.exceptions import ValidationError
    from django.core.validators import validate_email

    if any(not ch.isprintable() for ch in args["subject"]):  # CR, LF and every other line break among them
        raise ToolError(f"subject {args['subject'][:200]!r} has a line break or a control character", retryable=False)
    for address in args["to"]:
        try:
            validate_email(address)
        except ValidationError:
            raise ToolError(f"to: {address[:200]!r} is not an email address", retryable=False) from None


def _mail_call(args: dict[str, Any], key: str, timeout: float) -> Any:
    import smtplib

    from django.core.mail import EmailMessage

    # SMTP cannot be asked afterwards whether a message went out, so email.send has no
    # reconcile hook: an interrupted send is confirmed by a person, never re-sent blindly.
    message = EmailMessage(
        args["subject"],
        args["body"],
        to=args["to"],
        headers={"Idempotency-Key": key, "Message-ID": f"<{key.replace(':', '.')}@runtime>"},
    )
    # Right before connecting, as http.request's request hook: a worker frozen since its lease
    # was confirmed for the call, and thawed after a takeover, sends nothing. (Not after
    # connecting: a mail server slow to greet would then refuse the sends of a worker whose
    # heartbeat kept its lease all along.)
    leases.still_confirmed()
    try:
        sent = message.send(using="default")
    except (smtplib.SMTPServerDisconnected, smtplib.SMTPConnectError, ConnectionError, TimeoutError) as exc:
        raise ToolError(f"mail server unreachable: {exc}", retryable=True) from exc
    except smtplib.SMTPException as exc:
        raise ToolError(f"mail refused: {exc}", retryable=False) from exc
    return {"sent": sent, "to": args["to"]}


register(
    Tool(
        name="email.send",
        input_schema={
            "type": "object",
            "properties": {
                "to": {"type": "array", "items": {"type": "string", "format": "email"}, "minItems": 1},
                "subject": {"type": "string", "maxLength": 300},
                "body": {"type": "string"},
            },
            "required": ["to", "subject", "body"],
            "additionalProperties": False,
        },
        call=_mail_call,
        check=_mail_check,
    )
)


# --- mcp.call: a tool on a remote MCP server, through the official SDK -------------------


def _remote(fn: Callable[[], Any]) -> Any:
    from ledger_app import mcp_client

    try:
        answer = fn()
    except mcp_client.RemoteError as exc:
        raise ToolError(str(exc), retryable=exc.retryable) from exc
    if isinstance(answer, mcp_client.RemoteTask):
        return Pending(
            answer.task_id,
            tool_text(f"remote task {answer.status}: {answer.message}".strip(": ")),
            (answer.poll_interval_ms or 1000) / 1000,
        )
    return answer


def _credential_headers(args: dict[str, Any]) -> dict[str, str]:
    """A task names a credential; its secret stays in the worker's environment
    (RUNTIME_CREDENTIAL_<NAME>), never in task input, the ledger, events or logs."""
    if not (name := args.get("credential")):
        return {}
    env = f"RUNTIME_CREDENTIAL_{name.upper()}"
    if not (secret := os.getenv(env)):
        raise ToolError(f"credential {name!r} is not configured on this worker ({env})", retryable=False)
    return {"Authorization": f"Bearer {secret}"}


def _mcp_call(args: dict[str, Any], key: str, timeout: float) -> Any:
    from ledger_app import mcp_client

    _allowed(args["server"])
    headers = {**_credential_headers(args), **trace_headers()}  # the SDK's HTTP client is not instrumented
    return _remote(
        lambda: mcp_client.call_tool(
            args["server"],
            args["tool"],
            args.get("arguments", {}),
            key=key,
            timeout=args.get("timeoutSeconds", timeout),
            headers=headers,
        )
    )


def _mcp_poll(args: dict[str, Any], ref: str, timeout: float) -> Any:
    from ledger_app import mcp_client

    _allowed(args["server"])
    headers = {**_credential_headers(args), **trace_headers()}
    return _remote(lambda: mcp_client.get_task(args["server"], ref, timeout=timeout, headers=headers))


register(
    Tool(
        name="mcp.call",
        input_schema={
            "type": "object",
            "properties": {
                "server": {"type": "string", "pattern": "^https?://"},
                "tool": {"type": "string", "minLength": 1},
                "arguments": {"type": "object"},
                "credential": {"type": "string", "pattern": "^[A-Za-z0-9_]+$"},  # a bearer token by name
                # per call: the caller knows how long the remote tool takes to answer
                "timeoutSeconds": {"type": "number", "exclusiveMinimum": 0, "maximum": 600},
            },
            "required": ["server", "tool"],
            "additionalProperties": False,
        },
        call=_mcp_call,
        # The remote cannot be asked about a call by our key (MCP has no such verb): a call
        # interrupted before its answer (or its task id) was stored is confirmed by a person.
        poll=_mcp_poll,
    )
)
