"""A scripted language model behind real HTTP: the OpenAI Chat Completions wire
(POST /v1/chat/completions) and Anthropic's Messages wire (POST /v1/messages), for the
official SDKs to talk to. It plays a script of answers in order and counts what it receives.

    python tests/scripted_llm.py --port 8124 --script script.json

The script is a JSON list; each entry is one answer:
    {"toolCalls": [{"name": ..., "arguments": {...} or "raw string"}], "text": "...",
     "usage": {"input": n, "output": n}}    a model answer (arguments as a string are sent as
                                            is: malformed JSON is how a model gets it wrong)
    {"status": 429}                          an error status, then the next entry
    {"status": 429, "retryAfter": "2"}       ... with a Retry-After header (seconds or an HTTP date)
    {"hangOnce": seconds, ...answer}         the first request it meets waits this long (a
                                            timeout, or a worker killed mid-call); the next
                                            request gets the answer

A deterministic model: a request identical to one already answered gets the same answer
again without using up an entry (a call made again after a crash asks the same).

GET /stats  {"requests": n, "answered": n, "byWire": {...}, "arrivals": [time.time() of each request],
             "prompts": [the user prompts in order],
             "models": [the model named by each request], "tools": [the tool names each offered]}
"""

from __future__ import annotations

import argparse
import hashlib
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

lock = threading.Lock()
script: list[dict[str, Any]] = []
state: dict[str, Any] = {
    "next": 0,
    "requests": 0,
    "answered": 0,
    "arrivals": [],
    "byWire": {},
    "prompts": [],
    "models": [],
    "tools": [],
    "hung": set(),
    "cache": {},
}


def _prompt(wire: str, body: dict[str, Any]) -> str:
    messages = body.get("messages", [])
    user = [m for m in messages if m.get("role") == "user"]
    content = user[-1]["content"] if user else ""
    return content if isinstance(content, str) else json.dumps(content)


def _openai(entry: dict[str, Any], n: int, model: str) -> dict[str, Any]:
    def raw(arguments: Any) -> str:
        return arguments if isinstance(arguments, str) else json.dumps(arguments)

    calls = [
        {"id": f"call_{n}_{i}", "type": "function", "function": {"name": c["name"], "arguments": raw(c["arguments"])}}
        for i, c in enumerate(entry.get("toolCalls", []))
    ]
    usage = entry.get("usage", {"input": 100, "output": 20})
    message: dict[str, Any] = {"role": "assistant", "content": entry.get("text")}
    if calls:
        message["tool_calls"] = calls
    return {
        "id": f"chatcmpl-{n}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": "tool_calls" if calls else "stop"}],
        "usage": {
            "prompt_tokens": usage["input"],
            "completion_tokens": usage["output"],
            "total_tokens": usage["input"] + usage["output"],
        },
    }


def _anthropic(entry: dict[str, Any], n: int, model: str) -> dict[str, Any]:
    content: list[dict[str, Any]] = []
    if entry.get("text"):
        content.append({"type": "text", "text": entry["text"]})
    content += [
        {
            "type": "tool_use",
            "id": f"toolu_{n}_{i}",
            "name": c["name"],
            "input": c["arguments"] if isinstance(c["arguments"], dict) else {"_raw": c["arguments"]},
        }
        for i, c in enumerate(entry.get("toolCalls", []))
    ]
    usage = entry.get("usage", {"input": 100, "output": 20})
    return {
        "id": f"msg_{n}",
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": "tool_use" if entry.get("toolCalls") else "end_turn",
        "stop_sequence": None,
        "usage": {"input_tokens": usage["input"], "output_tokens": usage["output"]},
    }


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def _send(self, status: int, body: object, headers: dict[str, str] | None = None) -> None:
        data = json.dumps(body).encode()
        try:
            self.send_response(status)
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except OSError:
            pass  # the caller gave up (timed out, or its worker was killed)

    def do_POST(self) -> None:
        raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        body = json.loads(raw or b"{}")
        wire = "anthropic" if self.path.endswith("/messages") else "openai"
        digest = hashlib.sha256(raw).hexdigest()
        with lock:
            state["requests"] += 1
            state["arrivals"].append(time.time())
            state["byWire"][wire] = state["byWire"].get(wire, 0) + 1
            state["prompts"].append(_prompt(wire, body))
            state["models"].append(body.get("model"))
            state["tools"].append([t.get("name") or t.get("function", {}).get("name") for t in body.get("tools", [])])
            n = state["requests"]
            entry, hang = state["cache"].get(digest), 0.0
            if entry is None:
                if state["next"] >= len(script):
                    return self._send(500, {"error": {"message": "the script has no more answers"}})
                entry = script[state["next"]]
                if entry.get("hangOnce") and state["next"] not in state["hung"]:
                    state["hung"].add(state["next"])
                    hang = float(entry["hangOnce"])
                else:
                    state["next"] += 1
        if hang:
            time.sleep(hang)
            return self._send(503, {"error": {"message": "hung"}})  # nobody is listening by now
        if "status" in entry:
            headers = {"Retry-After": entry["retryAfter"]} if "retryAfter" in entry else None
            return self._send(entry["status"], {"error": {"type": "rate_limit_error", "message": "slow down"}}, headers)
        with lock:
            state["answered"] += 1
            state["cache"][digest] = entry
        self._send(200, (_anthropic if wire == "anthropic" else _openai)(entry, n, body.get("model", "")))

    def do_GET(self) -> None:
        with lock:
            self._send(200, {k: v for k, v in state.items() if k not in ("hung", "cache")})

    def log_message(self, *args: object) -> None:
        pass


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--script", required=True)
    options = parser.parse_args()
    with open(options.script) as f:
        script.extend(json.load(f))
    ThreadingHTTPServer(("127.0.0.1", options.port), Handler).serve_forever()
