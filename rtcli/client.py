"""HTTP and SSE over the public API only (README "API"); no Django, no database."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import httpx


class ApiError(Exception):
    """An HTTP error answer. Its body is whatever came: the API's {"error": {code, message}},
    or anything a proxy or a broken server sends instead."""

    def __init__(self, status: int, body: Any) -> None:
        error = body.get("error") if isinstance(body, dict) else None
        error = error if isinstance(error, dict) else {"message": error if error is not None else body}
        super().__init__(f"HTTP {status}: {str(error.get('message', body))[:300]}")
        self.status, self.body = status, body
        self.code = error.get("code") if isinstance(error.get("code"), str) else ""


class BadAnswer(Exception):
    """A success answer that is not what the API sends (not JSON, not an object, not an
    event stream): a proxy's page, another service on the port."""


class BadInput(ValueError):
    """An argument the client cannot send as given."""


def segment(value: str, what: str) -> str:
    """`value` as one path segment: quoted, so a task id or a name never walks to another
    path ("../keys" read the key listing as if it were the task)."""
    if value in ("", ".", "..") or not value.isprintable():
        raise BadInput(f"{what} {value!r} is not a valid {what}")
    return quote(value, safe="")


def _body(response: httpx.Response) -> Any:
    try:
        return response.json()
    except ValueError:  # not JSON, or not in the charset it claims
        return {"error": {"message": response.text[:200] or f"(an empty {response.status_code} answer)"}}


@dataclass
class Event:
    type: str
    data: dict[str, Any]


class Client:
    def __init__(self, base_url: str, api_key: str, *, timeout: float = 30) -> None:
        self.base_url = base_url.rstrip("/")
        # A header carries visible ASCII only: anything else failed as the request was built.
        if not api_key.isascii() or not api_key.isprintable() or " " in api_key:
            raise BadInput("the API key has characters no API key has (spaces, line breaks, non-ASCII)")
        try:
            self.http = httpx.Client(
                base_url=self.base_url, timeout=timeout, headers={"Authorization": f"Bearer {api_key}"}
            )
        except httpx.InvalidURL as exc:
            raise BadInput(f"--url {base_url!r} is not a URL: {exc}") from None

    def _call(self, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
        response = self.http.request(method, path, **kwargs)
        if response.status_code >= 400:
            raise ApiError(response.status_code, _body(response))
        try:
            body = response.json()
        except ValueError:
            body = None
        if not isinstance(body, dict):  # every success the API answers is a JSON object
            said = response.headers.get("content-type") or "no Content-Type"
            raise BadAnswer(
                f"HTTP {response.status_code} {method} {path}: not a JSON object ({said}): {response.text[:200]!r}"
            )
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
        return self._call("GET", f"/runtime/tasks/{segment(task_id, 'task id')}")

    def artifacts(self, task_id: str) -> list[dict[str, Any]]:
        return self._call("GET", f"/runtime/tasks/{segment(task_id, 'task id')}/artifacts")["results"]

    def artifact(self, task_id: str, name: str) -> bytes:
        response = self.http.get(f"/runtime/tasks/{segment(task_id, 'task id')}/artifacts/{segment(name, 'name')}")
        if response.status_code >= 400:
            raise ApiError(response.status_code, _body(response))
        return response.content

    def result(self, task_id: str) -> dict[str, Any]:
        return self._call("GET", f"/runtime/tasks/{segment(task_id, 'task id')}/result")

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
            f"/runtime/tasks/{segment(task_id, 'task id')}/steering",
            json={
                "commandId": command_id,
                "type": type,
                "payload": payload,
                "expectedVersion": expected_version,
                "reason": reason,
            },
        )

    def answer(self, task_id: str, key: str, answer: Any, *, reason: str = "") -> dict[str, Any]:
        path = f"/runtime/tasks/{segment(task_id, 'task id')}/inputs/{segment(key, 'input key')}"
        return self._call("POST", path, json={"answer": answer, "reason": reason})

    def events(self, task_id: str, *, reconnect_for: float = 60) -> Iterator[Event]:
        """The task's events by the client contract (docs/streaming.md): a snapshot first,
        duplicates dropped by seq, a fresh snapshot (type "task.snapshot") after a gap, and
        a reconnect (with a fresh snapshot) when the connection drops. Ends after "terminal"."""
        last, down_since = -1, None
        while True:
            try:
                with self.http.stream(
                    "GET", f"/runtime/tasks/{segment(task_id, 'task id')}/events", timeout=httpx.Timeout(10, read=60)
                ) as response:
                    if response.status_code >= 400:
                        response.read()
                        raise ApiError(response.status_code, _body(response))
                    if (said := response.headers.get("content-type", "")).split(";")[0].strip() != "text/event-stream":
                        # Read as a stream that never ends the task, it was asked for again and again.
                        raise BadAnswer(f"HTTP {response.status_code} for the events: not an event stream ({said})")
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
