"""Rate limits and quotas over real HTTP (the Django test client) on the shared Redis: per
key and per tenant on REST, SSE connects and /mcp (429 + Retry-After; on /mcp the JSON-RPC
error), failed authentications per client address on the three, the per-tenant cap on queued
tasks, sign-in lockout for the dashboard and admin (django-axes), and that a Redis that is down
or hung lets requests through, quickly."""

from __future__ import annotations

import json
import logging
import random
import socket
import time
from collections.abc import Iterator

import httpx
import pytest
import redis
from django.test import Client

from conftest import Processes, free_port, make_persona, wait_until
from mcp_server.protocol import MODERN, TASKS_EXT
from runtime_site import ratelimit
from steering_app.actions import do_cancel_task
from tasks_app.access import console
from tasks_app.actions import do_create_task
from tasks_app.models import Task
from tasks_app.tests.test_engine import new_task
from tests.mcp_stream import PostStream
from tests.test_mcp_tasks import modern_body, modern_headers

pytestmark = pytest.mark.django_db

# One window for the whole test (about 31 years): a count never resets halfway through.
LONG_WINDOW = 10**9


@pytest.fixture(autouse=True)
def fresh_limiter() -> Iterator[None]:
    ratelimit._skip_until = 0.0  # a failure in an earlier test must not switch limits off here
    ratelimit._refused_until.clear()
    yield
    ratelimit._skip_until = 0.0
    ratelimit._refused_until.clear()


def limit(settings, **values: int) -> None:
    limits = {
        "window_seconds": LONG_WINDOW,
        **{f"{s}_per_{w}": 0 for s in ratelimit.SURFACES for w in ("key", "tenant")},
        **values,
    }
    settings.RUNTIME = {**settings.RUNTIME, "limits": {**settings.RUNTIME["limits"], **limits}}


def rest(token: str, path: str = "/runtime/tasks", address: str = "127.0.0.1"):
    return Client(headers={"Authorization": f"Bearer {token}"}, REMOTE_ADDR=address).get(path)


def mcp(token: str, address: str = "127.0.0.1"):
    meta = {
        "io.modelcontextprotocol/protocolVersion": MODERN,
        "io.modelcontextprotocol/clientCapabilities": {"extensions": {TASKS_EXT: {}}},
    }
    body = {"jsonrpc": "2.0", "id": 9, "method": "tools/list", "params": {"_meta": meta}}
    return Client(REMOTE_ADDR=address).post(
        "/mcp",
        data=json.dumps(body),
        content_type="application/json",
        headers={
            "Authorization": f"Bearer {token}",
            "Accept": "application/json, text/event-stream",
            "MCP-Protocol-Version": MODERN,
            "Mcp-Method": "tools/list",
        },
    )


def sse(token: str, task: Task, address: str = "127.0.0.1"):
    response = Client(REMOTE_ADDR=address).get(
        f"/runtime/tasks/{task.id}/events", headers={"Authorization": f"Bearer {token}"}
    )
    if response.streaming:
        response.close()
    return response


def until_refused(send, most: int = 50) -> tuple[int, object]:
    """(requests accepted before the first refusal, that refusal)."""
    for n in range(most):
        response = send()
        if response.status_code == 429:
            return n, response
        assert response.status_code == 200, response.content
    raise AssertionError(f"no 429 in {most} requests")


def test_rest_is_limited_per_key_with_retry_after(alice, settings):
    limit(settings, rest_per_key=5)
    accepted, refused = until_refused(lambda: rest(alice.token))
    assert accepted == 5
    assert refused.json()["error"]["code"] == "throttled" and "key" in refused.json()["error"]["message"]
    assert 0 < int(refused["Retry-After"]) <= LONG_WINDOW
    # another key of the same tenant has its own allowance
    assert rest(make_persona("acme", "amy", "operator").token).status_code == 200


def test_rest_is_limited_per_tenant_across_keys(alice, victor, mallory, settings):
    limit(settings, rest_per_key=100, rest_per_tenant=8)
    tokens = [alice.token, victor.token]
    sent = iter(range(100))
    accepted, refused = until_refused(lambda: rest(tokens[next(sent) % 2]))
    assert accepted == 8 and "tenant" in refused.json()["error"]["message"]
    assert rest(alice.token).status_code == 429 and rest(victor.token).status_code == 429
    assert rest(mallory.token).status_code == 200  # another tenant is not held up


# the SSE and MCP views close their connections, which would end a test transaction
@pytest.mark.django_db(transaction=True)
def test_mcp_is_limited_with_the_json_rpc_error(alice, settings):
    limit(settings, mcp_per_key=3)
    accepted, refused = until_refused(lambda: mcp(alice.token))
    assert accepted == 3
    error = refused.json()
    assert error["jsonrpc"] == "2.0" and error["id"] == 9 and error["error"]["code"] == ratelimit_code()
    assert int(refused["Retry-After"]) > 0
    assert rest(alice.token).status_code == 200  # each surface counts on its own


def ratelimit_code() -> int:
    from mcp_server.views import RATE_LIMITED

    return RATE_LIMITED


# the SSE and MCP views close their connections, which would end a test transaction
@pytest.mark.django_db(transaction=True)
def test_sse_connects_are_limited(alice, settings):
    limit(settings, sse_per_key=2)
    task = new_task(alice)
    accepted, refused = until_refused(lambda: sse(alice.token, task))
    assert accepted == 2
    assert refused.json()["error"]["code"] == "throttled" and int(refused["Retry-After"]) > 0


# A key of the right shape that no one was issued: a lookup and a hash each time it is tried.
WRONG_KEY = "rt_0123456789ab_" + "x" * 43


@pytest.fixture
def addresses(settings) -> Iterator[tuple[str, str]]:
    """Two client addresses of this test's own (IPv6 documentation range, each its own /64), and
    their failure counts removed from the shared Redis afterwards."""
    prefix = f"2001:db8:{random.getrandbits(16):x}:{random.getrandbits(16):x}"
    url, pattern = settings.REDIS_URL, f"{settings.RUNTIME_DEPLOYMENT}:authfail:*:{prefix[:-1]}*"
    yield f"{prefix}::7", f"{prefix[:-1]}{(int(prefix[-1], 16) + 1) % 16:x}::7"
    with redis.Redis.from_url(url) as client:  # the test may have turned Redis off
        for key in client.scan_iter(pattern):
            client.delete(key)


def refused_after_failures(send, most: int = 50) -> tuple[int, object]:
    """(failed authentications answered 401 before the first 429, that 429)."""
    for n in range(most):
        response = send()
        if response.status_code == 429:
            return n, response
        assert response.status_code == 401, response.content
        assert 'error="invalid_token"' in response["WWW-Authenticate"]
    raise AssertionError(f"no 429 in {most} failed authentications")


# the SSE and MCP views close their connections, which would end a test transaction
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("surface", ["rest", "sse", "mcp"])
def test_failed_authentications_are_limited_per_client_address(alice, settings, addresses, surface):
    """A wrong key cost a lookup and a hash (a forged token an RSA verification) as often as
    anyone cared to send one: nothing counted failures, only proven keys' requests."""
    limit(settings, auth_failures_per_address=3)
    attacker, neighbour = addresses
    task = new_task(alice)
    send = {
        "rest": lambda token, address: rest(token, address=address),
        "sse": lambda token, address: sse(token, task, address=address),
        "mcp": lambda token, address: mcp(token, address=address),
    }[surface]
    failed, refused = refused_after_failures(lambda: send(WRONG_KEY, attacker))
    assert failed == 3
    assert 0 < int(refused["Retry-After"]) <= LONG_WINDOW
    if surface == "mcp":  # the JSON-RPC twin of the 429, as for a request rate limit
        error = refused.json()
        assert error["id"] == 9 and error["error"]["code"] == ratelimit_code()
        assert "failed authentications" in error["error"]["message"]
    else:
        assert refused.json()["error"]["code"] == "throttled"
        assert "failed authentications" in refused.json()["error"]["message"]
    # Refused before its credential is looked at: a right key from there too, until the window ends ...
    assert send(alice.token, attacker).status_code == 429
    # ... and only there: another client (another /64) is not held up, nor counted with it.
    assert send(alice.token, neighbour).status_code == 200
    assert send(WRONG_KEY, neighbour).status_code == 401


def test_the_embedded_profile_counts_failed_authentications_in_the_web_process(alice, settings, addresses):
    limit(settings, auth_failures_per_address=2)
    settings.REDIS_URL = ""  # the embedded default: no Redis
    ratelimit._local_failures.clear()
    attacker, neighbour = addresses
    failed, refused = refused_after_failures(lambda: rest(WRONG_KEY, address=attacker))
    assert failed == 2 and int(refused["Retry-After"]) > 0
    assert rest(alice.token, address=attacker).status_code == 429
    assert rest(alice.token, address=neighbour).status_code == 200


def test_the_queue_cap_refuses_a_create_but_not_its_replay(alice, settings):
    settings.RUNTIME = {**settings.RUNTIME, "limits": {**settings.RUNTIME["limits"], "queued_tasks_per_tenant": 2}}
    client = alice.client()
    body = {"agent": "noop", "input": {"steps": 1}}
    first = client.post("/runtime/tasks", body, format="json", headers={"Idempotency-Key": "one"})
    assert first.status_code == 201
    assert client.post("/runtime/tasks", body, format="json").status_code == 201
    third = client.post("/runtime/tasks", body, format="json")
    assert third.status_code == 429 and third.json()["error"]["code"] == "quota_exceeded"
    replay = client.post("/runtime/tasks", body, format="json", headers={"Idempotency-Key": "one"})
    assert replay.status_code == 200 and replay.json()["taskId"] == first.json()["taskId"]
    assert Task.objects.filter(tenant=alice.tenant).count() == 2
    Task.objects.filter(tenant=alice.tenant).update(status="working")  # they started: room again
    assert client.post("/runtime/tasks", body, format="json").status_code == 201


@pytest.fixture
def hung_redis() -> Iterator[str]:
    """A port that accepts connections and never answers: a frozen Redis."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    yield f"redis://127.0.0.1:{server.getsockname()[1]}/0"
    server.close()


@pytest.mark.parametrize("down", ["refused", "hung"])
def test_a_redis_that_is_down_or_hung_lets_requests_through_quickly(alice, settings, caplog, hung_redis, down):
    limit(settings, rest_per_key=1, mcp_per_key=1)
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        refused_url = f"redis://127.0.0.1:{probe.getsockname()[1]}/0"
    settings.REDIS_URL = refused_url if down == "refused" else hung_redis
    with caplog.at_level(logging.WARNING, logger="runtime_site.ratelimit"):
        started = time.monotonic()
        statuses = [rest(alice.token).status_code for _ in range(5)] + [mcp(alice.token).status_code]
        elapsed = time.monotonic() - started
    assert statuses == [200] * 6  # fail open: over the limit of 1, and no 500
    assert "rate limits not enforced" in caplog.text
    # one Redis timeout at most (0.25 s), then Redis is left alone: no wait per request
    assert elapsed < 5, elapsed


def login(path: str, username: str, password: str):
    return Client().post(path, {"username": username, "password": password})


@pytest.mark.parametrize("path", ["/dashboard/login/", "/admin/login/"])
def test_sign_in_locks_out_after_repeated_wrong_passwords(alice, path):
    alice.user.set_password("right-pw-123")
    alice.user.is_staff = True
    alice.user.save()
    assert login(path, "alice", "right-pw-123").status_code == 302  # signs in
    wrong = [login(path, "alice", "wrong").status_code for _ in range(6)]
    assert wrong == [200] * 4 + [429] * 2  # the form again, until the 5th failure locks the name
    locked = login(path, "alice", "right-pw-123")
    assert locked.status_code == 429  # the right password no longer helps
    other = "/admin/login/" if path.startswith("/dashboard") else "/dashboard/login/"
    assert login(other, "alice", "right-pw-123").status_code == 429  # one lockout for both


@pytest.mark.django_db(transaction=True)
def test_a_key_holds_at_most_its_share_of_waiting_mcp_answers(alice, processes: Processes):
    """A listen is one request to the rate limit, then looks at the database four times a
    second for as long as its tasks run: a key opening its allowance every minute piled them
    up without end. Past limits.mcp_streams_per_key open at once, a new listen is 429 with
    Retry-After (-32029), and a place comes back when one ends. uvicorn, no worker."""
    port = free_port()
    processes.web(port, LIMITS_MCP_STREAMS_PER_KEY="2")
    url = f"http://127.0.0.1:{port}/mcp"
    who = console(alice.tenant, f"user:{alice.user.pk}")
    tasks = [do_create_task(who, agent="noop", input={"steps": 1})[0] for _ in range(3)]

    def listen(request_id: int, task: Task) -> dict:
        return modern_body(request_id, "subscriptions/listen", {"notifications": {"taskIds": [str(task.id)]}})

    headers = modern_headers(alice.token, "subscriptions/listen")
    streams = [PostStream(url, listen(i, task), headers) for i, task in enumerate(tasks[:2])]
    wait_until(lambda: all(s.messages for s in streams), timeout=20, what="both listens acknowledged")

    with httpx.stream("POST", url, json=listen(3, tasks[2]), headers=headers, timeout=10) as refused:
        assert refused.status_code == 429, refused.headers  # before: a third stream, and so on without end
        body = json.loads(refused.read())
    assert body["error"]["code"] == -32029 and body["id"] == 3
    assert int(refused.headers["Retry-After"]) >= 1

    do_cancel_task(tasks[0].id, who=who, reason="frees a place")  # its listen ends with the task
    wait_until(lambda: streams[0].closed, timeout=20, what="the cancelled task's listen to end")
    third = PostStream(url, listen(4, tasks[2]), headers)
    wait_until(lambda: third.messages or third.closed, timeout=20, what="the third listen to answer")
    assert third.status == 200 and third.methods()[0] == "notifications/subscriptions/acknowledged"
