"""An open event stream ends once its key is revoked or its user deactivated (issue 16):
it asks again every stream.auth_recheck_seconds, events or not. A real SSE client (httpx,
conftest.SseClient) against uvicorn; the reconnect gets the 401."""

from __future__ import annotations

import httpx
import pytest

from conftest import Processes, SseClient, free_port, make_persona, wait_until
from tasks_app.auth import issue_api_key, revoke_api_key
from tasks_app.models import ApiKey
from tasks_app.tests.test_engine import new_task

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
