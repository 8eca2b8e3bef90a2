"""Start tests/scripted_llm.py (a scripted model behind real HTTP) from a test."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import httpx

from conftest import ROOT, Processes, answers, free_port, wait_until


class ScriptedModel:
    def __init__(self, processes: Processes, tmp: Path, script: list[dict[str, Any]]) -> None:
        self.port = free_port()
        path = tmp / f"script-{self.port}.json"
        path.write_text(json.dumps(script))
        processes.start(
            "model",
            [sys.executable, str(ROOT / "tests" / "scripted_llm.py"), "--port", str(self.port), "--script", str(path)],
        )
        self.url = f"http://127.0.0.1:{self.port}"
        wait_until(lambda: answers(f"{self.url}/stats"), timeout=10, what="the scripted model")

    def stats(self) -> dict[str, Any]:
        return httpx.get(f"{self.url}/stats", timeout=5).json()

    def env(self, wire: str = "openai", **overrides: str) -> dict[str, str]:
        """The worker's llm section pointed here: the default model on the OpenAI wire and
        `second` on Anthropic's (wire="anthropic": the other way round)."""
        claude = {"provider": "anthropic", "base_url": self.url, "model": "scripted-claude"}
        gpt = {"provider": "openai", "base_url": f"{self.url}/v1", "model": "scripted-gpt"}
        default, second = (gpt, claude) if wire == "openai" else (claude, gpt)
        return {
            "LLM_PROVIDER": default["provider"],
            "LLM_BASE_URL": default["base_url"],
            "LLM_MODEL": default["model"],
            "LLM_API_KEY_ENV": "SCRIPTED_MODEL_KEY",
            "SCRIPTED_MODEL_KEY": "sk-test",
            "LLM_BACKOFF_SECONDS": "0.2",
            "LLM_MODELS": json.dumps({"second": second}),
            **overrides,
        }
