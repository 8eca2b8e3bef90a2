"""What flows in from a tool's answer is masked wherever it lands: a remote's 4xx body that
quotes the payload (emails, card numbers, tokens, passwords) reaches the failure reason, the
audit record, the terminal event, the task's error and the ledger only masked and bounded.
The remote is a real HTTP server on loopback; the engine runs in-process on PostgreSQL."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from ledger_app.models import LedgerEntry
from tasks_app import engine
from tasks_app.access import console
from tasks_app.actions import do_create_task
from tasks_app.agents.base import Agent, StepContext, register
from tasks_app.models import AuditRecord, Task
from tasks_app.redaction import MASK, RedactingFilter, redact, tool_text

EMAIL, CARD, TOKEN = "ann.lee@example.com", "4111 1111 1111 1111", "ghp_" + "Z" * 36
JWT = "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiJhbm4ifQ.c2lnbmF0dXJlc2lnbmF0dXJl"
PAYLOAD = {
    "customer": EMAIL,
    "card": CARD,
    "note": f"use {TOKEN}",
    "password": "hunter2-secret",
    "session": JWT,
    "phone": "+1 555 0100",
    "filler": "x" * 2000,
}


def refusing_remote(status: int, content_type: str, body: Callable[[bytes], bytes], path: str) -> Iterator[str]:
    """A real HTTP server on loopback that refuses every POST with `status` and body(what it
    received), as many APIs do; yields its URL."""

    class Remote(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            data = body(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Remote)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}{path}"
    server.shutdown()
    server.server_close()


@pytest.fixture
def remote() -> Iterator[str]:
    """Refuses every call with a 422 that quotes the whole request body."""
    yield from refusing_remote(
        422,
        "application/json",
        lambda received: json.dumps({"error": "invalid customer", "received": received.decode()}).encode(),
        "/customers",
    )


def leaked(text: str) -> list[str]:
    return [v for v in (EMAIL, CARD, TOKEN, "hunter2-secret", JWT, "555 0100") if v in text]


@pytest.mark.django_db(transaction=True)
def test_a_remote_error_body_quoting_the_payload_lands_masked_and_bounded(alice, remote, settings):
    settings.RUNTIME = {
        **settings.RUNTIME,
        "security": {**settings.RUNTIME["security"], "http_allowlist": ["127.0.0.1"]},
    }
    task, _ = do_create_task(
        console(alice.tenant, "user:test"), agent="webhook", input={"url": remote, "payload": PAYLOAD, "count": 1}
    )
    while engine.run_slice(task.id, worker_id="w") is engine.SliceOutcome.CONTINUE:
        pass
    task = Task.objects.get(id=task.id)
    assert task.status == "failed" and "HTTP 422" in task.error["message"]
    failed = AuditRecord.objects.get(task=task, to_status="failed")
    terminal = task.events.get(type="terminal").data
    entry = LedgerEntry.objects.get(task=task)
    places = {
        "task error": json.dumps(task.error),
        "status message": task.status_message,
        "audit reason": failed.reason,
        "audit data": json.dumps(failed.data),
        "terminal event": json.dumps(terminal),
        "ledger error": json.dumps(entry.error),
    }
    for place, text in places.items():
        assert not leaked(text), f"{place} leaks {leaked(text)}: {text[:300]}"
    assert MASK in task.error["message"] and "invalid customer" in task.error["message"]
    # bounded: the 2000-character echo is cut, and says how much was left out
    assert len(task.error["message"]) < 500 and "more characters" in task.error["message"]


# Secrets as a remote's configuration or code quotes them, not as JSON: a name with the
# secret word inside it, a quoted value after an unquoted name, a bare number after a quoted
# name, a PEM private key.
AWS_SECRET, CLIENT_KEY, DB_PASSWORD = (
    "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY",
    "sk9-live-0123456789abcdef",
    "90210731",
)
PEM_BODY = "MIIEvQIBADANBgkqhkiG9w0BAQEFAASCBKcwggSjAgEAAoIBAQC7"
CONFIG_ERROR = (
    f"config rejected: aws_secret_access_key: {AWS_SECRET}\n"
    f'client = Client(api_key="{CLIENT_KEY}")\n'
    f'{{"db_password": {DB_PASSWORD}}}\n'
    f"-----BEGIN PRIVATE KEY-----\n{PEM_BODY}\n-----END PRIVATE KEY-----"
)


@pytest.fixture
def config_remote() -> Iterator[str]:
    """Refuses every call with a 400 that quotes its own configuration."""
    yield from refusing_remote(400, "text/plain", lambda _: CONFIG_ERROR.encode(), "/deploy")


@pytest.mark.django_db(transaction=True)
def test_secrets_a_remote_quotes_from_its_configuration_land_masked(alice, config_remote, settings, caplog):
    settings.RUNTIME = {
        **settings.RUNTIME,
        "security": {**settings.RUNTIME["security"], "http_allowlist": ["127.0.0.1"]},
    }
    task, _ = do_create_task(
        console(alice.tenant, "user:test"), agent="webhook", input={"url": config_remote, "payload": {}, "count": 1}
    )
    while engine.run_slice(task.id, worker_id="w") is engine.SliceOutcome.CONTINUE:
        pass
    task = Task.objects.get(id=task.id)
    assert task.status == "failed" and "HTTP 400" in task.error["message"]
    places = {
        "task error": json.dumps(task.error),
        "audit reason": AuditRecord.objects.get(task=task, to_status="failed").reason,
        "terminal event": json.dumps(task.events.get(type="terminal").data),
        "ledger error": json.dumps(LedgerEntry.objects.get(task=task).error),
    }
    for place, text in places.items():
        found = [v for v in (AWS_SECRET, CLIENT_KEY, DB_PASSWORD, PEM_BODY) if v in text]
        assert not found, f"{place} leaks {found}: {text[:400]}"
    # What was there is still said: the names stay, the values go.
    assert "aws_secret_access_key: ***" in task.error["message"], task.error["message"]
    assert 'api_key="***' in task.error["message"], task.error["message"]


def test_secret_words_inside_a_name_mask_its_value_but_plural_counts_stay():
    for text, masked in [
        ("aws_secret_access_key = abc/def+ghi", "aws_secret_access_key = ***"),
        ("SECRET_KEY_BASE=0f1e2d3c", "SECRET_KEY_BASE=***"),
        ("clientSecretValue: zzz", "clientSecretValue: ***"),
        ("token_type=bearer&x=1", "token_type=***&x=1"),
        ("max_tokens: 4096 is too large", "max_tokens: 4096 is too large"),
        ("sessions=12", "sessions=12"),
        ("password: 'hunter 2'", "password: '***'"),
    ]:
        assert redact(text) == masked, (text, redact(text))


def test_values_that_look_like_secrets_or_personal_data_are_masked_in_any_text():
    text = (
        f"to {EMAIL}, card {CARD}, Authorization: Bearer abcdefgh12345678, {JWT}, "
        f"'phone': '+1 555 0100', password=hunter2-secret, order 1234567890123, task 2026-11-30"
    )
    masked = redact(text)
    assert not leaked(masked) and "abcdefgh12345678" not in masked
    # what only looks like a number stays: a non-card number (fails the checksum) and dates
    assert "order 1234567890123" in masked and "2026-11-30" in masked
    assert redact({"nested": [f"mail {EMAIL}"]}) == {"nested": [f"mail {MASK}"]}
    assert tool_text("y" * 1000).endswith("(700 more characters)")


def test_a_logged_traceback_quoting_a_tool_answer_is_masked(caplog):
    logger = logging.getLogger("tasks_app.test_tool_redaction")
    redacting = RedactingFilter()
    caplog.handler.addFilter(redacting)
    try:
        with caplog.at_level(logging.ERROR, logger=logger.name):
            try:
                raise ValueError(f"remote said: customer {EMAIL} card {CARD}")
            except ValueError:
                logger.exception("step failed")
    finally:
        caplog.handler.removeFilter(redacting)
    assert "remote said" in caplog.text and not leaked(caplog.text)


@register
class LeakyAgent(Agent):
    """Fails its one step with an error that names a secret at `at` characters in."""

    name = "test_leaky_error"
    input_schema = {"type": "object", "properties": {"at": {"type": "integer"}}}

    def start(self, input: dict[str, Any], goal: str) -> dict[str, Any]:
        return {"at": input["at"]}

    def next_step(self, state: dict[str, Any]) -> str | None:
        return "connect"

    def run_step(self, ctx: StepContext, state: dict[str, Any]) -> dict[str, Any]:
        raise RuntimeError("x" * state["at"] + f" {TOKEN} rejected")

    def result(self, state: dict[str, Any]) -> dict[str, Any]:
        return {}


@pytest.mark.parametrize("at", [470, 478, 975, 985])
def test_a_secret_cut_in_half_by_the_reasons_limit_is_still_masked(alice, at):
    # Cut first and masked after, the token's first characters outlived the cut (too short to
    # look like a token any more) in the reason (500 characters) or the error (1,000).
    task, _ = do_create_task(console(alice.tenant, "user:test"), agent="test_leaky_error", input={"at": at})
    engine.run_slice(task.id, worker_id="w1")
    task = Task.objects.get(id=task.id)
    reasons = AuditRecord.objects.filter(task=task).values_list("reason", flat=True)
    stored = [task.status_message, json.dumps(task.error), *reasons]
    assert task.status == "failed"
    assert not [text for text in stored if "ghp_" in text or "ZZZZ" in text]
