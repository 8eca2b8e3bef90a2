"""The model client (ledger_app/llm.py) through the official openai and anthropic SDKs,
against a scripted model behind real HTTP (tests/scripted_llm.py)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from django.test import override_settings

from ledger_app import llm, tools
from ledger_app.actions import _call_and_settle
from ledger_app.tests.test_side_effects import started
from tasks_app import leases
from tasks_app.agents.tools import get_tool
from tasks_app.tests.test_engine import new_task
from tests.scripted import ScriptedModel

ARGS = {
    "system": "be brief",
    "prompt": "say hi",
    "tools": [{"name": "http_request", "description": "d", "parameters": {"type": "object"}}],
}


def _runtime(model: ScriptedModel, **llm_overrides):
    from django.conf import settings

    runtime = json.loads(json.dumps(settings.RUNTIME))
    runtime["llm"].update(
        provider="openai",
        base_url=f"{model.url}/v1",
        model="scripted-gpt",
        timeout_seconds=2,
        input_cost_per_mtok=1000,
        output_cost_per_mtok=2000,
        models={"second": {"provider": "anthropic", "base_url": model.url, "model": "claude"}},
        **llm_overrides,
    )
    return override_settings(RUNTIME=runtime)


@pytest.mark.parametrize("model_name, wire", [("default", "openai"), ("second", "anthropic")])
def test_both_wires_give_tool_calls_usage_and_cost(processes, tmp_path, model_name, wire):
    model = ScriptedModel(
        processes,
        tmp_path,
        [
            {
                "toolCalls": [{"name": "http_request", "arguments": {"url": "http://x"}}],
                "text": "calling",
                "usage": {"input": 300, "output": 40},
            }
        ],
    )
    with _runtime(model):
        answer = llm.chat({**ARGS, "model": model_name})
    assert answer["toolCalls"][0]["name"] == "http_request"
    arguments = answer["toolCalls"][0]["arguments"]
    assert (json.loads(arguments) if isinstance(arguments, str) else arguments) == {"url": "http://x"}
    assert answer["usage"] == {
        "inputTokens": 300,
        "outputTokens": 40,
        "totalTokens": 340,
        "cost": pytest.approx(300 * 1000 / 1e6 + 40 * 2000 / 1e6),
    }
    assert answer["model"] == model_name and answer["provider"] == wire
    assert model.stats()["byWire"] == {wire: 1}


def test_429_5xx_and_timeouts_are_retryable_and_a_bad_request_is_not(processes, tmp_path):
    model = ScriptedModel(
        processes, tmp_path, [{"status": 429}, {"status": 503}, {"hangOnce": 10, "text": "late"}, {"status": 400}]
    )
    with _runtime(model):
        for expected in ("RateLimitError", "InternalServerError", "APITimeoutError"):
            with pytest.raises(tools.ToolError, match=expected) as caught:
                llm.chat(ARGS)
            assert caught.value.retryable
        assert llm.chat(ARGS)["text"] == "late"  # the hung answer, asked again
        with pytest.raises(tools.ToolError, match="BadRequestError") as caught:
            llm.chat({**ARGS, "prompt": "again"})
        assert not caught.value.retryable


def test_an_unknown_model_is_a_permanent_error_naming_the_configured_ones(processes, tmp_path):
    model = ScriptedModel(processes, tmp_path, [])
    with _runtime(model), pytest.raises(tools.ToolError, match="configured: default, second") as caught:
        llm.chat({**ARGS, "model": "gpt-9"})
    assert not caught.value.retryable


@pytest.mark.parametrize("model_name", ["default", "second"])
def test_a_429s_retry_after_reaches_the_error_on_both_wires(processes, tmp_path, model_name):
    model = ScriptedModel(processes, tmp_path, [{"status": 429, "retryAfter": "7"}])
    with _runtime(model), pytest.raises(tools.ToolError, match="RateLimitError") as caught:
        llm.chat({**ARGS, "model": model_name})
    assert caught.value.retryable and caught.value.retry_after == 7


def test_a_retry_waits_as_long_as_the_remotes_retry_after_asks(alice, processes, tmp_path):
    """The SDKs' own retries are off (max_retries=0): ours asked again after the configured
    back-off however long the remote said to wait, and spent the attempts inside a 429 window."""
    import anthropic  # noqa: F401  (imported on the first error: seconds on a busy machine)

    model = ScriptedModel(processes, tmp_path, [{"status": 429, "retryAfter": "3"}, {"text": "ok"}])
    task = new_task(alice)
    lease = leases.claim(task.id, worker_id="w1", ttl=60)
    tool = replace(get_tool(llm.TOOL_NAME), backoff=0.01, retries=1)
    with _runtime(model):
        answer = _call_and_settle(lease, started(task, llm.TOOL_NAME, 1, lease.epoch), tool, ARGS)
    first, second = model.stats()["arrivals"]
    assert answer["text"] == "ok" and second - first >= 3, second - first


@pytest.mark.parametrize(
    "headers, expected",
    [
        ({"retry-after": "3"}, 3.0),
        ({"retry-after-ms": "1500", "retry-after": "9"}, 1.5),
        ({"retry-after": "Wed, 21 Oct 2015 07:28:00 GMT"}, 0.0),  # a date in the past: now
        ({"retry-after": "soon"}, None),
        ({"retry-after": "Wed, 21 Oct 2015 07:28:00"}, None),  # no zone: unreadable, not a crash
        ({"retry-after-ms": "nan"}, None),
        ({"retry-after": "9" * 400}, None),  # beyond a float's range
        ({"retry-after-ms": "-5"}, 0.0),
        ({}, None),
    ],
)
def test_retry_after_reads_seconds_dates_and_milliseconds_and_never_raises(headers, expected):
    assert tools.retry_after(headers) == expected
