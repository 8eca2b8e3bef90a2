"""HTTP and SSE over the public API only (README "API"); no Django, no database."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx


class ApiError(Exception):
    def __init__(self, status: int, body: dict[str, Any]) -> None:
        error = body.get("error", {}) if isinstance(body, dict) else {}
        super().__init__(f"HTTP {status}: {error.get('message', body)}")
        self.status, self.body, self.code = status, body, error.get("code", "")


@dataclass
class Event:
    type: str
    data: dict[str, Any]


class Client:
    def __init__(self, base_url: str, api_key: str, *, timeout: float = 30) -> None:
        self.base_url = base_url.rstrip("/")
        self.http = httpx.Client(
            base_url=self.base_url, timeout=timeout, headers={"Authorization": f"Bearer {api_key}"}
        )

    def _call(self, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
        response = self.http.request(method, path, **kwargs)
        try:
            body = response.json()
        except ValueError:
            body = {"error": {"message": response.text[:200]}}
        if response.status_code >= 400:
            raise ApiError(response.status_code, body)
        return body

    def submit(
        self,
        agent: str,
        input: dict[str, Any],
        *,
        goal: str = "",
        priority: int = 5,
        idempotency_key: str | None = None,
    ) -> dict[str, Any]:
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        return self._call(
            "POST",
            "/runtime/tasks",
            headers=headers,
            json={"agent": agent, "input": input, "goal": goal, "priority": priority},
        )

    def tasks(self, *, status: str | None = None, limit: int = 20) -> list[dict[str, Any]]:
        params: dict[str, Any] = {"limit": limit}
        if status:
            params["status"] = status
        return self._call("GET", "/runtime/tasks", params=params)["results"]

    def snapshot(self, task_id: str) -> dict[str, Any]:
        return self._call("GET", f"/runtime/tasks/{task_id}")

    def artifacts(self, task_id: str) -> list[dict[str, Any]]:
        return self._call("GET", f"/runtime/tasks/{task_id}/artifacts")["results"]

    def artifact(self, task_id: str, name: str) -> bytes:
        response = self.http.get(f"/runtime/tasks/{task_id}/artifacts/{name}")
        if response.status_code >= 400:
            try:
                body = response.json()
            except ValueError:
                body = {"error": {"message": response.text[:200]}}
            raise ApiError(response.status_code, body)
        return response.content

    def result(self, task_id: str) -> dict[str, Any]:
        return self._call("GET", f"/runtime/tasks/{task_id}/result")

    def steer(
        self,
        task_id: str,
        type: str,
        payload: dict[str, Any],
        *,
        expected_version: int,
        command_id: str,
        reason: str = "",
    ) -> dict[str, Any]:
        return self._call(
            "POST",
            f"/runtime/tasks/{task_id}/steering",
            json={
                "commandId": command_id,
                "type": type,
                "payload": payload,
                "expectedVersion": expected_version,
                "reason": reason,
            },
        )

    def answer(self, task_id: str, key: str, answer: Any, *, reason: str = "") -> dict[str, Any]:
        return self._call("POST", f"/runtime/tasks/{task_id}/inputs/{key}", json={"answer": answer, "reason": reason})

    def events(self, task_id: str, *, reconnect_for: float = 60) -> Iterator[Event]:
        """The task's events by the client contract (docs/streaming.md): a snapshot first,
        duplicates dropped by seq, a fresh snapshot (type "task.snapshot") after a gap, and
        a reconnect (with a fresh snapshot) when the connection drops. Ends after "terminal"."""
        last, down_since = -1, None
        while True:
            try:
                with self.http.stream(
                    "GET", f"/runtime/tasks/{task_id}/events", timeout=httpx.Timeout(10, read=60)
                ) as response:
                    if response.status_code >= 400:
                        response.read()
                        raise ApiError(response.status_code, response.json())
                    down_since = None
                    for event in _parse(response.iter_lines()):
                        seq = event.data.get("seq", -1)
                        if seq <= last:
                            continue
                        if event.type != "task.snapshot" and last >= 0 and seq > last + 1:
                            # Missed something: the snapshot is the truth; then this event.
                            yield Event("task.snapshot", self.snapshot(task_id) | {"seq": seq})
                        last = seq
                        yield event
                        if event.type == "terminal":
                            return
            except httpx.TransportError:
                down_since = down_since or time.monotonic()
                if time.monotonic() - down_since > reconnect_for:
                    raise
                time.sleep(1)  # reconnect backoff


def _parse(lines: Iterator[str]) -> Iterator[Event]:
    fields: dict[str, str] = {}
    for line in lines:
        if line == "":
            if "data" in fields and fields.get("event") not in (None, "stream-open", "keep-alive", "message"):
                try:
                    data = json.loads(fields["data"])
                except ValueError:
                    data = {}
                if isinstance(data, dict):
                    yield Event(fields["event"], data)
            fields = {}
        elif not line.startswith(":"):
            name, _, value = line.partition(":")
            value = value.removeprefix(" ")
            fields[name] = fields[name] + "\n" + value if name == "data" and name in fields else value
