"""Secrets and personal fields never reach events or audit records."""

from __future__ import annotations

from typing import Any

import pytest

from tasks_app import engine
from tasks_app.access import console
from tasks_app.actions import do_create_task
from tasks_app.agents.base import Agent, StepContext, register
from tasks_app.models import AuditRecord
from tasks_app.redaction import _MAYBE_SECRET, MASK, _mask, _mask_all, redact

TOKEN = "rt_0123456789ab_" + "s" * 40


def test_it_masks_secret_keys_personal_fields_and_token_values():
    masked = redact(
        {
            "Authorization": "Bearer abcdef1234567890",
            "password": "hunter2",
            "apiKey": "k",
            "email": "ann@example.com",
            "nested": [{"client_secret": "x", "note": f"used {TOKEN} today"}],
            "header": "Bearer abcdef1234567890",
            "aws": "key AKIAABCDEFGHIJKLMNOP here",
            "count": 3,
            "message": "reviewed 40 of 100",
        }
    )
    assert masked["Authorization"] == masked["password"] == masked["apiKey"] == masked["email"] == MASK
    assert masked["nested"] == [{"client_secret": MASK, "note": f"used {MASK} today"}]
    assert masked["header"] == f"Bearer {MASK}" and masked["aws"] == f"key {MASK} here"
    assert masked["count"] == 3 and masked["message"] == "reviewed 40 of 100"


def test_it_masks_a_card_number_sent_as_a_json_number():
    masked = redact(
        {"card": 4111111111111111, "cards": [5555555555554444, 378282246310005, 2223003122003222],
         "order": 4111111111111112, "createdMs": 1733289600000, "count": 3, "ok": True}
    )  # fmt: skip
    assert masked["card"] == MASK and masked["cards"] == [MASK, MASK, MASK]  # Mastercard's 2-series too
    # Not a card: a failed checksum, a timestamp, a count, a boolean.
    assert [masked[k] for k in ("order", "createdMs", "count", "ok")] == [4111111111111112, 1733289600000, 3, True]


@register
class ChattyAgent(Agent):
    name = "test_chatty"

    def start(self, input: dict[str, Any], goal: str) -> dict[str, Any]:
        return {"done": False}

    def next_step(self, state: dict[str, Any]) -> str | None:
        return None if state["done"] else "talk"

    def run_step(self, ctx: StepContext, state: dict[str, Any]) -> dict[str, Any]:
        ctx.log(f"calling the CRM with Bearer {TOKEN}", token=TOKEN, email="ann@example.com")
        return {"done": True}

    def result(self, state: dict[str, Any]) -> dict[str, Any]:
        return {}


@pytest.mark.django_db(transaction=True)
def test_events_and_audit_records_carry_no_secrets(alice):
    task, _ = do_create_task(console(alice.tenant, "user:test"), agent="test_chatty", input={}, goal="x")
    while engine.run_slice(task.id, worker_id="w") is engine.SliceOutcome.CONTINUE:
        pass
    log = task.events.get(type="log").data
    assert log["token"] == MASK and log["email"] == MASK and TOKEN not in log["message"]
    for record in AuditRecord.objects.filter(task=task):
        assert TOKEN not in str(record.data) and TOKEN not in record.reason


def test_logs_carry_no_tokens(caplog):
    import logging

    from tasks_app.redaction import RedactingFilter

    logger = logging.getLogger("tasks_app.test")
    handler_filter = RedactingFilter()
    with caplog.at_level(logging.INFO, logger="tasks_app.test"):
        caplog.handler.addFilter(handler_filter)
        logger.info("calling %s with Authorization: Bearer %s", "the CRM", TOKEN)
        caplog.handler.removeFilter(handler_filter)
    assert TOKEN not in caplog.text and "Bearer ***" in caplog.text


def test_every_process_logs_through_the_filter(settings):
    assert settings.LOGGING["handlers"]["console"]["filters"] == ["redact"]
    assert settings.LOGGING["filters"]["redact"]["()"] == "tasks_app.redaction.RedactingFilter"


def test_it_masks_secrets_named_inside_strings():
    """An error message or a URL names a secret by its key: the value goes, the key stays."""
    for text, masked in [
        ("GET https://h/x?api_key=plain123&page=2", "GET https://h/x?api_key=***&page=2"),
        ("https://bob:hunter2@example.com/x", "https://bob:***@example.com/x"),
        ("{'password': 'hunter 2', 'user': 'bob'}", "{'password': '***', 'user': 'bob'}"),
        ('{"client_secret": "s3cr3t", "n": 1}', '{"client_secret": "***", "n": 1}'),
        ("login failed: password=hunter2; retrying", "login failed: password=***; retrying"),
        ("X-Api-Key: abc123secret", "X-Api-Key: ***"),
        ("reviewed 40 of 100 (token budget: 3)", "reviewed 40 of 100 (token budget: 3)"),
        ("mysql://db?user=bob&pwd=hunter2", "mysql://db?user=bob&pwd=***"),
        ("key_passphrase: open sesame", "key_passphrase: *** sesame"),
        ("auth with github_pat_11ABCDEFG0123456789_abcdefghijklmnop", "auth with ***"),
        ("maps key AIzaSyA1234567890abcdefghijklmnopqrstuv rejected", "maps key *** rejected"),
    ]:
        assert redact(text) == masked, text


@pytest.mark.parametrize(
    ("text", "masked"),
    [
        # a callback URL carried in another URL's query string (an OAuth redirect, a tool's log line)
        (
            "GET https://h/cb?next=https%3A%2F%2Fapp%2Fx%3Faccess_token%3Dabc123def%26page%3D2",
            "GET https://h/cb?next=https%3A%2F%2Fapp%2Fx%3Faccess_token%3D***%26page%3D2",
        ),
        ("x=client_secret%3Ds3cr3t%2B%2Fx%3D%3D%26a%3D1", "x=client_secret%3D***%26a%3D1"),  # base64's +/= stay in it
        ("x=api_key%253Dplain123%2526page%253D2", "x=api_key%253D***%2526page%253D2"),  # encoded twice
        # encoded whitespace around the separator: a tab, a form's +
        ("x=client_secret%09%3D%09s3cr3t%26a%3D1", "x=client_secret%09%3D%09***%26a%3D1"),
        ("x=client_secret+%3D+s3cr3t&a=1", "x=client_secret+%3D+***&a=1"),
        ("h=Authorization%3A%20Bearer%20abcdef123456", "h=Authorization%3A%20Bearer%20***"),
        # JSON in a query string: to the encoded closing quote, spaces and all
        (
            "q=%7B%22password%22%3A%22hunter%202%22%2C%22user%22%3A%22bob%22%7D",
            "q=%7B%22password%22%3A%22***%22%2C%22user%22%3A%22bob%22%7D",
        ),
        ("u=https%3A%2F%2Fbob%3Ahunter2%40example.com%2Fx", "u=https%3A%2F%2Fbob%3A***%40example.com%2Fx"),
        # personal fields (security.redact_fields) and an email, as for their plain forms
        ("form: %26email%3Dann%40example.com%26phone%3D%2B15551234", "form: %26email%3D***%26phone%3D***"),
        ("to=ann%40example.com&n=2", "to=***&n=2"),
        # counts are no secrets, encoded or not; nor is an escape that names none
        (
            "tokens%3D3 max_tokens%3D10 page%3D2 100%25 %E2%80%AE",
            "tokens%3D3 max_tokens%3D10 page%3D2 100%25 %E2%80%AE",
        ),
    ],
)
def test_it_masks_percent_encoded_secrets_and_personal_fields(text, masked):
    """A URL-encoded `access_token%3D...` went through whole: every pattern wanted a raw = or :."""
    assert redact(text) == masked


@pytest.mark.parametrize(
    ("unit", "times"),
    [
        ("x", 100_000),
        ("a-", 50_000),
        ("1", 100_000),
        ("%E2%80%AE", 30_000),
        ("%3A%2F%2Fa%3Ab", 20_000),
        ("%2522", 30_000),
    ],
)
def test_masking_a_long_line_takes_one_pass_not_one_per_character(unit, times):
    """A line is masked in time that grows with its length, not with its square: a 100 KB run
    of name characters took about 30 minutes (5 s for 5 KB, 4x for each doubling). In a
    process of its own, so that a regression fails at the deadline instead of hanging."""
    import subprocess
    import sys

    from conftest import ROOT

    script = f"from tasks_app.redaction import _mask; _mask({unit!r} * {times} + ' api_key=hunter2 tail')"
    try:
        subprocess.run([sys.executable, "-c", script], cwd=ROOT, check=True, timeout=20)
    except subprocess.TimeoutExpired:
        pytest.fail(f"masking {unit!r} * {times} ran past 20 s: quadratic")


# One text each pattern of _mask_all masks; the quick look must send every one of them, and
# every text one character away from one (deleted, or replaced), exactly where the full
# masking would: a branch of it missing or wrong lets one through unmasked.
MASKED_SEEDS = [
    "Authorization: Bearer abcdefghijklmnop",
    "rt_0123456789ab_abcdefghijklmnopqrstuv",
    "id AKIAABCDEFGHIJKLMNOP here",
    "sk-abcdefghijklmnop1234",
    "github_pat_abcdefghijklmnopqrstuv",
    "AIzaabcdefghijklmnopqrstuvwxyz0123456",
    "-----BEGIN RSA PRIVATE KEY-----abc-----END RSA PRIVATE KEY-----",
    '{"password": "hunter2"}',
    "api_key=hunter2&n=1",
    '"pin_secret": 1234',
    "https://user:pw@example.com/x",
    "https%3A%2F%2Fann%3Apw%40example.com",
    "access_token%3Dabc%26n%3D1",
    "eyJabcdefghij.klmnopqrst.uvwxyzabcd",
    "mail ann@example.com now",
    "mail ann%40example.com now",
    "card 4111 1111 1111 1111 ok",
    "card 5555-5555-5555-4444 ok",
    "card 2223 0031 2200 3222 ok",  # Mastercard's 2-series
    "phone: +15551234",
    '"date_of_birth": "1990-01-01"',
    "iban=DE89370400440532013000",
]


def near(text: str) -> list[str]:
    out = [text]
    for i in range(len(text)):
        out.append(text[:i] + text[i + 1 :])
        out += [text[:i] + c + text[i + 1 :] for c in ("x", "-", "%", "0", " ", "@", ":")]
    return out


@pytest.mark.parametrize("seed", MASKED_SEEDS)
def test_the_quick_look_never_passes_a_text_the_full_masking_would_change(seed):
    """_mask skips the substitutions when a text holds nothing they could match: for each of
    these texts it must answer exactly as the substitutions do."""
    personal = frozenset({"email", "phone", "ssn", "iban", "date_of_birth"})
    assert _mask_all(seed, personal) != seed  # the seed is masked: it tests something
    for text in near(seed):
        assert _mask(text, personal) == _mask_all(text, personal), text
        assert _mask(text) == _mask_all(text, frozenset()), text


@pytest.mark.parametrize(
    "text",
    [
        "2026-12-03T18:37:19.432448+00:00",  # a snapshot's createdAt: a fraction from 3 to 6
        "2026-12-03T18:37:19.599999+00:00",
        "order 4321 of 5678 at 3141-5926",  # four digits, never a card's thirteen
    ],
)
def test_the_quick_look_passes_timestamps_and_short_numbers_without_the_substitutions(text):
    # Every snapshot event carries two timestamps; their fraction's first four digits sent
    # them through all the substitutions, a millisecond of a create's CPU time.
    assert _MAYBE_SECRET.search(text) is None and _mask_all(text, frozenset()) == text
