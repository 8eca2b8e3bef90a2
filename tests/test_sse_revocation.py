"""An open event stream ends once its key is revoked or its user deactivated (issue 16):
it asks again every stream.auth_recheck_seconds, events or not. A real SSE client (httpx,
conftest.SseClient) against uvicorn; the reconnect gets the 401."""

from __future__ import annotations

import threading

import httpx
import pytest
from django.test import Client

from conftest import Processes, SseClient, free_port, make_persona, wait_until
from mcp_server.protocol import MODERN, TASKS_EXT
from tasks_app import engine
from tasks_app.auth import issue_api_key, revoke_api_key
from tasks_app.models import ApiKey
from tasks_app.tests.test_engine import new_task
from tests.mcp_stream import PostStream

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def base(processes: Processes) -> str:
    port = free_port()
    processes.web(port, STREAM_AUTH_RECHECK_SECONDS="1")
    return f"http://127.0.0.1:{port}"


def opened(url: str, token: str) -> SseClient:
    client = SseClient(url, token)
    wait_until(lambda: client.of("task.snapshot"), timeout=20, what="the stream to open with its snapshot")
    return client


def test_the_stream_of_a_revoked_key_ends_and_the_others_go_on(base, alice):
    task = new_task(alice, steps=3)  # no worker: the stream only waits
    url = f"{base}/runtime/tasks/{task.id}/events"
    _, other_token = issue_api_key(alice.tenant, alice.user, role="operator", name="second")
    revoked, kept = opened(url, alice.token), opened(url, other_token)
    revoke_api_key(ApiKey.objects.get(name="alice-key"))
    wait_until(lambda: not revoked.live, timeout=20, what="the revoked key's stream to end")
    assert kept.live  # the other key of the same user reads on
    again = httpx.get(url, headers={"Authorization": f"Bearer {alice.token}"}, timeout=10)
    assert again.status_code == 401 and "revoked" in again.json()["error"]["message"]
    kept.close()


def test_the_stream_of_a_deactivated_user_ends(base, alice):
    bob = make_persona("acme", "bob", "viewer")
    task = new_task(alice, steps=3)
    url = f"{base}/runtime/tasks/{task.id}/events"
    streams = [opened(url, bob.token), opened(url, alice.token)]
    bob.user.is_active = False
    bob.user.save(update_fields=["is_active"])
    wait_until(lambda: not streams[0].live, timeout=20, what="the deactivated user's stream to end")
    assert streams[1].live
    streams[1].close()


class SessionStream:
    """A dashboard session's stream (its cookie, no key), read on its own thread."""

    def __init__(self, url: str, user) -> None:
        client = Client()
        client.force_login(user)
        self.client, self.session = client, client.cookies["sessionid"].value
        self.lines = 0
        self.error: httpx.TransportError | None = None  # how the stream broke, if it did not end
        self._thread = threading.Thread(target=self._run, args=(url,), daemon=True)
        self._thread.start()

    def _run(self, url: str) -> None:
        try:
            with (
                httpx.Client(timeout=httpx.Timeout(10, read=60), cookies={"sessionid": self.session}) as client,
                client.stream("GET", url) as response,
            ):
                for _ in response.iter_lines():
                    self.lines += 1
        except httpx.TransportError as exc:  # a stream still open as its test ends: the web process stops
            self.error = exc

    @property
    def live(self) -> bool:
        return self._thread.is_alive()


def test_the_stream_of_a_session_that_logged_out_or_lost_its_password_ends(base, alice):
    """A session ends with a sign-out, and with a password change (Django's session hash):
    its open stream too, not only its next request."""
    bob, carol = make_persona("acme", "bob", "viewer"), make_persona("acme", "carol", "viewer")
    task = new_task(alice, steps=3)
    url = f"{base}/runtime/tasks/{task.id}/events"
    streams = {who.user.username: SessionStream(url, who.user) for who in (alice, bob, carol)}
    wait_until(lambda: all(s.lines for s in streams.values()), timeout=20, what="the streams to open")
    streams["alice"].client.logout()
    bob.user.set_password("changed by an admin")
    bob.user.save(update_fields=["password"])
    wait_until(lambda: not streams["alice"].live, timeout=20, what="the signed-out session's stream to end")
    wait_until(lambda: not streams["bob"].live, timeout=20, what="the stream of a session of an old password to end")
    assert streams["alice"].error is None and streams["bob"].error is None  # ended by the server, not broken
    assert streams["carol"].live
    again = httpx.get(url, cookies={"sessionid": streams["alice"].session}, timeout=10)
    assert again.status_code == 401


def test_an_mcp_stream_of_a_revoked_key_ends_before_it_hands_over_the_result(base, alice):
    """/mcp has long-lived answers too: subscriptions/listen and the legacy blocking
    tasks/result. They kept streaming to a revoked key, the task's result included."""
    task = new_task(alice, steps=2)  # no worker: the streams wait until the test runs it
    _, other_token = issue_api_key(alice.tenant, alice.user, role="operator", name="second")
    meta = {
        "io.modelcontextprotocol/protocolVersion": MODERN,
        "io.modelcontextprotocol/clientCapabilities": {"extensions": {TASKS_EXT: {}}},
    }
    listen = {"jsonrpc": "2.0", "id": 1, "method": "subscriptions/listen"}
    listen["params"] = {"_meta": meta, "notifications": {"taskIds": [str(task.id)]}}
    modern = {"MCP-Protocol-Version": MODERN, "Mcp-Method": "subscriptions/listen"}
    legacy = {"MCP-Protocol-Version": "2025-11-25"}
    blocking = {"jsonrpc": "2.0", "id": 3, "method": "tasks/result", "params": {"taskId": str(task.id)}}

    def opened(body: dict, headers: dict, token: str) -> PostStream:
        auth = {"Authorization": f"Bearer {token}", "Accept": "application/json, text/event-stream"}
        return PostStream(f"{base}/mcp", body, {**auth, **headers})

    revoked = [opened(listen, modern, alice.token), opened(blocking, legacy, alice.token)]
    kept = opened(listen, modern, other_token)
    wait_until(lambda: revoked[0].first("notifications/tasks") and kept.first("notifications/tasks"), timeout=20)
    revoke_api_key(ApiKey.objects.get(name="alice-key"))
    wait_until(lambda: all(s.closed for s in revoked), timeout=20, what="the revoked key's /mcp streams to end")
    for stream in revoked:
        assert stream.response()["error"]["code"] == -32000 and "Unauthorized" in stream.response()["error"]["message"]
    assert not kept.closed
    while engine.run_slice(task.id, worker_id="w1") is engine.SliceOutcome.CONTINUE:
        pass
    wait_until(lambda: kept.response() is not None, timeout=20, what="the other key's stream to end with the task")
    assert all("result" not in (s.response() or {}) for s in revoked)
