"""A POST to /mcp whose answer is an SSE stream, read with raw httpx on its own thread (for
what the SDKs cannot drive: legacy server requests by hand, subscriptions/listen taskIds)."""

from __future__ import annotations

import json
import threading
from typing import Any

import httpx


class PostStream:
    """Collects the stream's JSON-RPC messages (notifications, server requests, then the
    response) in order; `closed` once the stream ends (`error`: how, if it broke)."""

    def __init__(self, url: str, body: dict[str, Any], headers: dict[str, str]) -> None:
        self.messages: list[dict[str, Any]] = []
        self.status: int | None = None
        self.closed = False
        self.error: httpx.TransportError | None = None  # the connection broke (the web process stopped)
        self._args = (url, body, headers)
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        url, body, headers = self._args
        try:
            with (
                httpx.Client(timeout=httpx.Timeout(10, read=60)) as client,
                client.stream("POST", url, json=body, headers=headers) as response,
            ):
                self.status = response.status_code
                for line in response.iter_lines():
                    if line.startswith("data:"):
                        self.messages.append(json.loads(line.removeprefix("data:")))
        except httpx.TransportError as exc:
            # Kept for the test to look at, not raised: a stream still open when its test ends
            # breaks as the web process stops, on a thread nobody joins (pytest's warnings).
            self.error = exc
        finally:
            self.closed = True

    def methods(self) -> list[str]:
        return [m["method"] for m in self.messages if "method" in m]

    def first(self, method: str) -> dict[str, Any] | None:
        return next((m for m in self.messages if m.get("method") == method), None)

    def response(self) -> dict[str, Any] | None:
        return next((m for m in self.messages if "method" not in m), None)
