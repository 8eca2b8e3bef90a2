"""Language models, called like any other tool: `llm.chat` goes through the ledger (DESIGN §12).

Why a tool: the ledger then gives a model call what it gives every call. The guard checks
the task's budgets (tokens and cost included) before it; retries on a timeout, 429 or 5xx
are bounded, backed off and left in the row (attempts, durations); and the answer is
stored under the step's key, so a step that runs again after a crash or an approval gets
the same answer and asks for the same tool calls, which the ledger then replays instead
of making twice. A call lost with its worker is simply made again (a model call changes
nothing outside: its reconcile hook says "not done").

Two wires, each through its official SDK: OpenAI-compatible Chat Completions with tool
calling (`openai`; vLLM, Ollama, llama.cpp's server and OpenAI speak it) and Anthropic's
Messages API (`anthropic`). Both SDKs' own retries are off: ours are the ledger's.

Models are configured in config/runtime.yaml's `llm:` section (the default model) and
`llm.models` (more, by name). A key is named by its environment variable, never stored.

What a call takes and gives is provider-neutral:
    args   {"model": name, "system": str, "prompt": str,
            "tools": [{"name", "description", "parameters"}]}
    result {"model": name, "provider", "text": str, "toolCalls": [{"id", "name", "arguments"}],
            "usage": {"inputTokens", "outputTokens", "totalTokens", "cost"}, "finish": str}
`arguments` is what the model sent: a JSON string on the OpenAI wire (perhaps malformed:
the planner sends it back), an object on Anthropic's. Hidden reasoning is never kept.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass
from typing import Any

from django.conf import settings
from django.db.models import IntegerField, Sum
from django.db.models.fields.json import KeyTextTransform
from django.db.models.functions import Cast

from ledger_app import tools

TOOL_NAME = "llm.chat"
PROVIDERS = ("openai", "anthropic")
# The keys a named model may set; the ones it leaves out come from the `llm:` section itself.
MODEL_KEYS = (
    "provider",
    "base_url",
    "model",
    "api_key_env",
    "timeout_seconds",
    "max_output_tokens",
    "input_cost_per_mtok",
    "output_cost_per_mtok",
)


class UnknownModel(LookupError):
    pass


@dataclass(frozen=True)
class ModelConfig:
    name: str  # what a task names: "default" or a key of llm.models
    provider: str
    base_url: str
    model: str  # what the endpoint calls it
    api_key_env: str
    timeout_seconds: float
    max_output_tokens: int
    input_cost_per_mtok: float
    output_cost_per_mtok: float

    def api_key(self) -> str:
        # Local servers (vLLM, Ollama, llama.cpp) take any key; the SDKs insist on one.
        return (os.getenv(self.api_key_env, "") if self.api_key_env else "") or "unused"


def model_names() -> list[str]:
    return ["default", *sorted(settings.RUNTIME["llm"].get("models") or {})]


def model_config(name: str | None = None) -> ModelConfig:
    section = settings.RUNTIME["llm"]
    name = name or "default"
    own: dict[str, Any] = {}
    if name != "default":
        models = section.get("models") or {}
        if name not in models:
            raise UnknownModel(f"no model named {name!r} in llm.models; configured: {', '.join(model_names())}")
        own = models[name] or {}
        if unknown := set(own) - set(MODEL_KEYS):
            raise UnknownModel(f"llm.models.{name}: unknown keys {sorted(unknown)}")
    values = {key: own.get(key, section[key]) for key in MODEL_KEYS}
    if values["provider"] not in PROVIDERS:
        raise UnknownModel(f"model {name!r}: provider must be one of {PROVIDERS}, not {values['provider']!r}")
    return ModelConfig(name=name, **values)


# --- the two wires -----------------------------------------------------------------------------


def _retryable(exc: Exception) -> bool | None:
    """True: a timeout, a dropped connection, 429 or 5xx (ask again later); False: the request
    itself is wrong (400, 401, 404 ...); None: not an SDK error."""
    import anthropic
    import openai

    for sdk in (openai, anthropic):
        if isinstance(exc, sdk.APITimeoutError | sdk.APIConnectionError):
            return True
        if isinstance(exc, sdk.APIStatusError):
            return exc.status_code == 429 or exc.status_code >= 500
    return None


@functools.cache
def _client(provider: str, base_url: str, api_key: str, timeout: float, pid: int) -> Any:
    """One client per process and endpoint (made after the worker forks: `pid` in the key)."""
    if provider == "openai":
        import openai

        return openai.OpenAI(base_url=base_url, api_key=api_key, timeout=timeout, max_retries=0)
    import anthropic

    return anthropic.Anthropic(base_url=base_url, api_key=api_key, timeout=timeout, max_retries=0)


def _openai(cfg: ModelConfig, args: dict[str, Any]) -> dict[str, Any]:
    client = _client("openai", cfg.base_url, cfg.api_key(), cfg.timeout_seconds, os.getpid())
    request: dict[str, Any] = {
        "model": cfg.model,
        "max_tokens": cfg.max_output_tokens,
        "messages": [{"role": "system", "content": args["system"]}, {"role": "user", "content": args["prompt"]}],
    }
    if args.get("tools"):
        request["tools"] = [
            {
                "type": "function",
                "function": {"name": t["name"], "description": t["description"], "parameters": t["parameters"]},
            }
            for t in args["tools"]
        ]
    response = client.chat.completions.create(**request)
    choice = response.choices[0]
    calls = [
        {"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
        for c in choice.message.tool_calls or []
        if getattr(c, "function", None) is not None
    ]
    usage = response.usage
    return {
        "text": choice.message.content or "",
        "toolCalls": calls,
        "finish": choice.finish_reason or "",
        "inputTokens": usage.prompt_tokens if usage else 0,
        "outputTokens": usage.completion_tokens if usage else 0,
    }


def _anthropic(cfg: ModelConfig, args: dict[str, Any]) -> dict[str, Any]:
    client = _client("anthropic", cfg.base_url, cfg.api_key(), cfg.timeout_seconds, os.getpid())
    request: dict[str, Any] = {
        "model": cfg.model,
        "max_tokens": cfg.max_output_tokens,
        "system": args["system"],
        "messages": [{"role": "user", "content": args["prompt"]}],
    }
    if args.get("tools"):
        request["tools"] = [
            {"name": t["name"], "description": t["description"], "input_schema": t["parameters"]} for t in args["tools"]
        ]
    response = client.messages.create(**request)
    # Only text and tool_use blocks are kept: thinking blocks (hidden reasoning) never are.
    text = "".join(block.text for block in response.content if block.type == "text")
    calls = [
        {"id": block.id, "name": block.name, "arguments": block.input}
        for block in response.content
        if block.type == "tool_use"
    ]
    return {
        "text": text,
        "toolCalls": calls,
        "finish": response.stop_reason or "",
        "inputTokens": response.usage.input_tokens,
        "outputTokens": response.usage.output_tokens,
    }


MAX_DEPTH = 32  # tool-call arguments nested deeper are kept as their JSON text (the planner refuses them)


def _depth(value: Any) -> int:
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        deepest = max(deepest, depth)
        if depth > MAX_DEPTH:
            break
        if isinstance(item, dict):
            stack += [(v, depth + 1) for v in item.values()]
        elif isinstance(item, list):
            stack += [(v, depth + 1) for v in item]
    return deepest


def _storable(value: Any) -> Any:
    """The answer as the ledger can store it: PostgreSQL's jsonb refuses NUL and lone
    surrogates (both reach us from a JSON body as escapes), so they become U+FFFD; arguments
    nested past MAX_DEPTH become their JSON text, which the planner then refuses as malformed."""
    if isinstance(value, str):
        if "\x00" in value:
            value = value.replace("\x00", "\ufffd")
        try:
            value.encode()
        except UnicodeEncodeError:
            value = value.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
        return value
    if isinstance(value, dict):
        return {_storable(k): _storable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_storable(v) for v in value]
    return value


def chat(args: dict[str, Any]) -> dict[str, Any]:
    """One model call; ToolError(retryable=...) when it fails."""
    try:
        cfg = model_config(args.get("model"))
    except UnknownModel as exc:
        raise tools.ToolError(str(exc), retryable=False) from exc
    try:
        answer = (_openai if cfg.provider == "openai" else _anthropic)(cfg, args)
    except Exception as exc:
        retryable = _retryable(exc)
        if retryable is None:
            # RecursionError: a body nested too deep for the SDK to parse
            if isinstance(exc, AttributeError | TypeError | ValueError | KeyError | IndexError | RecursionError):
                # an answer that is not the wire's shape: the endpoint is not what config says
                raise tools.ToolError(
                    f"{cfg.name}: malformed answer: {type(exc).__name__}: {exc}", retryable=False
                ) from exc
            raise
        response = getattr(exc, "response", None)  # an APIStatusError's: a 429 may say when to ask again
        raise tools.ToolError(
            f"{cfg.name} ({cfg.provider} {cfg.model}): {type(exc).__name__}: {exc}"[:500],
            retryable=retryable,
            retry_after=tools.retry_after(response.headers) if response is not None else None,
        ) from exc
    for call in answer["toolCalls"]:
        if not isinstance(call["arguments"], str) and _depth(call["arguments"]) > MAX_DEPTH:
            call["arguments"] = json.dumps(call["arguments"])
    answer = _storable(answer)
    tokens_in, tokens_out = int(answer.pop("inputTokens") or 0), int(answer.pop("outputTokens") or 0)
    cost = (tokens_in * cfg.input_cost_per_mtok + tokens_out * cfg.output_cost_per_mtok) / 1_000_000
    return {
        **answer,
        "model": cfg.name,
        "provider": cfg.provider,
        "usage": {
            "inputTokens": tokens_in,
            "outputTokens": tokens_out,
            "totalTokens": tokens_in + tokens_out,
            "cost": round(cost, 8),
        },
    }


def tokens_used(task_id: Any) -> int:
    """The task's tokens so far, from the model calls' stored usage (the ledger counts each
    call once, however often its step ran)."""
    from ledger_app.models import EffectStatus, LedgerEntry

    total = LedgerEntry.objects.filter(task_id=task_id, tool=TOOL_NAME, status=EffectStatus.SUCCEEDED).aggregate(
        n=Sum(Cast(KeyTextTransform("totalTokens", KeyTextTransform("usage", "result")), IntegerField()))
    )["n"]
    return int(total or 0)


def _chat_call(args: dict[str, Any], key: str, timeout: float) -> Any:
    return chat(args)


_section = settings.RUNTIME["llm"]
tools.register(
    tools.Tool(
        name=TOOL_NAME,
        input_schema={
            "type": "object",
            "properties": {
                "model": {"type": "string"},
                "system": {"type": "string"},
                "prompt": {"type": "string"},
                "tools": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {
                            "name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"},
                            "description": {"type": "string"},
                            "parameters": {"type": "object"},
                        },
                        "required": ["name", "description", "parameters"],
                    },
                },
            },
            "required": ["system", "prompt"],
            "additionalProperties": False,
        },
        call=_chat_call,
        side_effect=False,  # a model call changes nothing outside: a cut or lost one is sent again
        timeout=float(_section["timeout_seconds"]),
        retries=int(_section["retries"]),
        backoff=float(_section["backoff_seconds"]),
    )
)
