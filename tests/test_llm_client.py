"""The model client (ledger_app/llm.py) through the official openai and anthropic SDKs,
against a scripted model behind real HTTP (tests/scripted_llm.py)."""

from __future__ import annotations

import json

import pytest
from django.test import override_settings

from ledger_app import llm, tools
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
