"""MCP authorization (2026-07-28, issue 16): the protected resource metadata (RFC 9728), a
401 whose WWW-Authenticate points at it, and bearer JWTs of a configured issuer beside API
keys. The issuer is tests/oauth_issuer.py: keys generated here, its JWKS served over
loopback HTTP. The end-to-end test runs the official SDK client against uvicorn and a
worker; the others drive the views in-process against the same issuer."""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import hashlib
import hmac
import json
import time
from collections.abc import Iterator
from datetime import UTC, datetime

import httpx
import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from django.contrib.auth import get_user_model
from django.test import Client

from conftest import Processes, free_port, wait_until
from mcp_server.protocol import MODERN, TASKS_EXT
from tasks_app.models import ApiKey, Task
from tests import mcp_client as mc
from tests.oauth_issuer import Issuer, ec_key, rsa_key

pytestmark = pytest.mark.django_db(transaction=True)

AUDIENCE = "http://testserver/mcp"  # the Django test client's host


@pytest.fixture
def issuer() -> Iterator[Issuer]:
    made = Issuer()
    yield made
    made.close()


@pytest.fixture
def configured(issuer: Issuer, settings) -> Issuer:
    settings.RUNTIME = {**settings.RUNTIME, "oauth": issuer.settings(AUDIENCE)}
    return issuer


def mcp(token: str | None, method: str = "tools/list", params: dict | None = None, name: str | None = None):
    meta = {
        "io.modelcontextprotocol/protocolVersion": MODERN,
        "io.modelcontextprotocol/clientCapabilities": {"extensions": {TASKS_EXT: {}}},
    }
    headers = {"Accept": "application/json, text/event-stream", "MCP-Protocol-Version": MODERN, "Mcp-Method": method}
    if name:
        headers["Mcp-Name"] = name
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    body = {"jsonrpc": "2.0", "id": 5, "method": method, "params": {"_meta": meta, **(params or {})}}
    return Client().post("/mcp", data=json.dumps(body), content_type="application/json", headers=headers)


def test_the_metadata_names_the_issuer_and_a_401_points_at_it(configured):
    metadata = Client().get("/.well-known/oauth-protected-resource")
    assert metadata.status_code == 200
    body = metadata.json()
    assert body["resource"] == AUDIENCE and body["authorization_servers"] == [configured.url]
    assert body["bearer_methods_supported"] == ["header"] and "runtime:operate" in body["scopes_supported"]
    assert Client().get("/.well-known/oauth-protected-resource/mcp").json() == body  # the path-inserted form

    refused = mcp(None)
    assert refused.status_code == 401 and refused.json()["error"]["code"] == -32000
    challenge = refused["WWW-Authenticate"]
    assert challenge.startswith("Bearer ")
    assert 'resource_metadata="http://testserver/.well-known/oauth-protected-resource"' in challenge
    bad = mcp("a.b.c")
    assert bad.status_code == 401 and 'error="invalid_token"' in bad["WWW-Authenticate"]
    assert "resource_metadata=" in bad["WWW-Authenticate"]


def test_a_token_of_the_issuer_acts_for_its_user_tenant_and_scopes(configured, alice, victor):
    token = configured.sign(configured.claims(AUDIENCE))
    listed = mcp(token)
    assert listed.status_code == 200, listed.content
    assert "noop" in {t["name"] for t in listed.json()["result"]["tools"]}
    started = mcp(token, "tools/call", {"name": "noop", "arguments": {"steps": 1}}, name="noop").json()["result"]
    task = Task.objects.get(id=started["taskId"])
    assert task.tenant == alice.tenant and task.created_by == f"user:{alice.user.pk}"
    # EC keys too; and the same token on REST
    ec_token = configured.sign(configured.claims(AUDIENCE), kid="ec-1")
    assert mcp(ec_token).status_code == 200
    rest = Client(headers={"Authorization": f"Bearer {ec_token}"}).get("/runtime/tasks")
    assert rest.status_code == 200 and str(task.id) in rest.content.decode()
    # read alone: may list, may not start
    reader = configured.sign(configured.claims(AUDIENCE, scope="runtime:read"))
    refused = mcp(reader, "tools/call", {"name": "noop", "arguments": {"steps": 1}}, name="noop").json()["result"]
    assert refused["isError"] and "operator" in refused["content"][0]["text"]
    # the membership caps the token: victor is a viewer, whatever the token says
    capped = configured.sign(configured.claims(AUDIENCE, sub="victor", scope="runtime:admin"))
    refused = mcp(capped, "tools/call", {"name": "noop", "arguments": {"steps": 1}}, name="noop").json()["result"]
    assert refused["isError"] and "operator" in refused["content"][0]["text"]
    # API keys keep working beside tokens
    assert mcp(alice.token).status_code == 200


def test_a_good_token_for_an_unknown_tenant_or_user_or_scope_is_forbidden(configured, alice, mallory):
    get_user_model().objects.create(username="nobody-here")
    for claims in (
        {"tenant": "initech"},  # no such tenant
        {"sub": "ghost"},  # no such user
        {"sub": "nobody-here"},  # a user, but not a member of acme
        {"sub": "mallory"},  # a member of globex, not of acme
        {"scope": "openid profile"},  # none of this server's scopes
    ):
        response = mcp(configured.sign(configured.claims(AUDIENCE, **claims)))
        assert response.status_code == 403, (claims, response.content)
        assert 'error="insufficient_scope"' in response["WWW-Authenticate"]
    alice.user.is_active = False
    alice.user.save()
    assert mcp(configured.sign(configured.claims(AUDIENCE))).status_code == 403


def b64(data: dict | bytes) -> str:
    raw = data if isinstance(data, bytes) else json.dumps(data).encode()
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def hs256(claims: dict, secret: bytes) -> str:
    """The algorithm-confusion forgery: an HMAC keyed with the issuer's public key."""
    signing_input = f"{b64({'alg': 'HS256', 'typ': 'JWT', 'kid': 'rsa-1'})}.{b64(claims)}"
    return f"{signing_input}.{b64(hmac.new(secret, signing_input.encode(), hashlib.sha256).digest())}"


def test_hostile_tokens_are_401_never_500(configured, alice):
    now = int(time.time())
    claims = configured.claims(AUDIENCE)
    public_pem = (
        configured.private["rsa-1"][0]
        .public_key()
        .public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    hostile = {
        "alg none": f"{b64({'alg': 'none', 'kid': 'rsa-1'})}.{b64(claims)}.",
        "alg none, signed part kept": f"{b64({'alg': 'none', 'kid': 'rsa-1'})}.{b64(claims)}.c2ln",
        "wrong key, same kid": configured.sign(claims, key=rsa_key()),
        "wrong EC key": configured.sign(claims, kid="ec-1", key=ec_key()),
        "unknown kid": jwt.encode(claims, rsa_key(), algorithm="RS256", headers={"kid": "made-up"}),
        "no kid": jwt.encode(claims, configured.private["rsa-1"][0], algorithm="RS256"),
        "HS256 with the public key as secret": hs256(claims, public_pem),
        "expired": configured.sign({**claims, "exp": now - 60}),
        "not yet valid": configured.sign({**claims, "nbf": now + 600}),
        "wrong aud": configured.sign({**claims, "aud": "https://elsewhere.example/mcp"}),
        "no aud": configured.sign({k: v for k, v in claims.items() if k != "aud"}),
        "wrong iss": configured.sign({**claims, "iss": "https://evil.example"}),
        "no exp": configured.sign({k: v for k, v in claims.items() if k != "exp"}),
        "no tenant claim": configured.sign({k: v for k, v in claims.items() if k != "tenant"}),
        "tenant not a string": configured.sign({**claims, "tenant": {"$ne": 1}}),
        "garbage": "not-a-token-at-all.really.no",
        "three dots of nothing": "..",
        "binary header": "\u00ff\u00fe.e30.e30",
        "huge": "a" * 20_000 + ".b.c",
        "truncated": configured.sign(claims)[:-20],
        "tampered claims": ".".join(
            [
                configured.sign(claims).split(".")[0],
                b64({**claims, "sub": "mallory"}),
                configured.sign(claims).split(".")[2],
            ]
        ),
    }
    for what, token in hostile.items():
        for response in (mcp(token), Client(headers={"Authorization": f"Bearer {token}"}).get("/runtime/tasks")):
            assert response.status_code == 401, (what, response.status_code, response.content[:300])
    assert mcp(configured.sign(claims)).status_code == 200  # and a good one still works


def test_a_token_is_verified_only_with_the_algorithm_its_key_is_for(configured, alice, settings):
    """The JWKS publishes rsa-1 for RS256: the same private key signing PS256 (an allowed
    algorithm, and one RSA keys can make) is not what the issuer vouched for. A key published
    without alg verifies its key type's algorithms only; none and HS* never, even configured."""
    claims = configured.claims(AUDIENCE)
    assert mcp(configured.sign(claims)).status_code == 200
    refused = mcp(configured.sign(claims, alg="PS256"))
    assert refused.status_code == 401, refused.content
    assert 'error="invalid_token"' in refused["WWW-Authenticate"]
    assert (
        Client(headers={"Authorization": f"Bearer {configured.sign(claims, alg='PS256')}"})
        .get("/runtime/tasks")
        .status_code
        == 401
    )

    configured.add("rsa-bare", rsa_key(), "RS256", publish_alg=False)
    for alg in ("RS256", "PS256"):
        assert mcp(configured.sign(claims, kid="rsa-bare", alg=alg)).status_code == 200, alg
    settings.RUNTIME["oauth"]["algorithms"] = ["RS256", "PS256", "ES256", "HS256", "none"]  # a careless config
    public_pem = (
        configured.private["rsa-1"][0]
        .public_key()
        .public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    for forged in (hs256(claims, public_pem), f"{b64({'alg': 'none', 'kid': 'rsa-1'})}.{b64(claims)}."):
        assert mcp(forged).status_code == 401


def test_a_token_without_the_read_scope_cannot_read_a_task(configured, alice):
    """As a key without read: MCP refuses the read as REST does, with the request's id."""
    started = mcp(alice.token, "tools/call", {"name": "noop", "arguments": {"steps": 1}}, name="noop")
    task_id = started.json()["result"]["taskId"]
    operate = configured.sign(configured.claims(AUDIENCE, scope="runtime:operate"))
    refused = mcp(operate, "tasks/get", {"taskId": task_id}, name=task_id)
    assert refused.status_code == 403 and refused.json()["id"] == 5, refused.content
    assert "viewer" in refused.json()["error"]["message"] and task_id not in refused.content.decode()
    rest = Client(headers={"Authorization": f"Bearer {operate}"}).get(f"/runtime/tasks/{task_id}")
    assert rest.status_code == 403
    reader = configured.sign(configured.claims(AUDIENCE, scope="runtime:read"))
    assert mcp(reader, "tasks/get", {"taskId": task_id}, name=task_id).json()["result"]["taskId"] == task_id


def test_a_new_key_of_the_issuer_is_fetched_on_its_first_token(configured, alice):
    assert mcp(configured.sign(configured.claims(AUDIENCE))).status_code == 200
    fetched = configured.fetches
    assert mcp(configured.sign(configured.claims(AUDIENCE))).status_code == 200
    assert configured.fetches == fetched  # cached
    configured.add("rsa-2", rsa_key(), "PS256")  # the issuer rotates in a new key
    assert mcp(configured.sign(configured.claims(AUDIENCE), kid="rsa-2")).status_code == 200
    assert configured.fetches == fetched + 1


def test_an_sdk_client_completes_a_task_with_a_jwt(issuer, alice, processes: Processes):
    """The official SDK (mcp 2.x) against uvicorn and a worker, authenticated only by the
    issuer's token: discovery, tools/list, a task created, polled and completed."""
    port = free_port()
    url = f"http://127.0.0.1:{port}/mcp"
    processes.web(port, **issuer.env(url))
    processes.worker(concurrency=1)
    token = issuer.sign(issuer.claims(url), kid="ec-1")

    async def scenario() -> tuple[str, str]:
        async with mc.client(url, token) as c:
            tools = {t.name for t in (await c.list_tools()).tools}
            assert "slow_compute" in tools
            created = await c.session.call_tool("slow_compute", {"seconds": 0.2, "label": "jwt"}, allow_claimed=True)
            assert isinstance(created, mc.CreateTaskResult)
            final = await mc.poll(c.session, created.task_id)
            assert final["status"] == "completed", final
            greeting = await c.call_tool("greet", {"name": "jwt"})
            return created.task_id, greeting.content[0].text

    task_id, greeting = asyncio.run(asyncio.wait_for(scenario(), timeout=120))
    task = Task.objects.get(id=task_id)
    assert task.status == "completed" and task.tenant == alice.tenant and task.created_by == f"user:{alice.user.pk}"
    assert greeting == "Hello, jwt!"

    async def refused() -> int:
        import httpx2

        async with httpx2.AsyncClient() as http:
            wrong = issuer.sign(issuer.claims("https://elsewhere.example/mcp"))
            return (await http.post(url, headers={"Authorization": f"Bearer {wrong}"}, json={})).status_code

    assert asyncio.run(refused()) == 401


def test_an_issuer_that_cannot_be_read_is_503_and_asked_once_per_backoff(configured, alice, settings):
    """An unreachable issuer is not the token's fault: a token whose key is cached goes on
    working, one whose key is not is 503 with Retry-After (a 401 would make the client throw
    a good token away), and the issuer is asked once per back-off, not once per request."""
    settings.RUNTIME["oauth"]["jwks_cache_seconds"] = 0  # every request finds the keys stale
    token = configured.sign(configured.claims(AUDIENCE))
    assert mcp(token).status_code == 200
    configured.mode = "error"
    fetched = configured.fetches
    for _ in range(10):
        assert mcp(token).status_code == 200  # the keys it had
    assert configured.fetches - fetched <= 1
    configured.add("rsa-2", rsa_key(), "RS256")  # a key it has not seen, while it cannot be read
    unseen = configured.sign(configured.claims(AUDIENCE), kid="rsa-2")
    refused = mcp(unseen)
    assert refused.status_code == 503 and int(refused["Retry-After"]) >= 1, refused.content
    assert refused.json()["error"]["code"] == -32003 and refused.json()["id"] == 5
    rest = Client(headers={"Authorization": f"Bearer {unseen}"}).get("/runtime/tasks")
    assert rest.status_code == 503 and int(rest["Retry-After"]) >= 1
    assert rest.json()["error"]["code"] == "issuer_unavailable"
    assert configured.fetches - fetched <= 1


def test_a_key_set_that_is_no_key_set_is_503_not_500(configured, alice):
    configured.mode = "garbage"  # a JSON list, not {"keys": [...]}
    token = configured.sign(configured.claims(AUDIENCE))
    assert mcp(token).status_code == 503
    assert Client(headers={"Authorization": f"Bearer {token}"}).get("/runtime/tasks").status_code == 503


def test_a_hung_issuer_holds_no_request_longer_than_one_fetch(issuer, alice, processes: Processes):
    """uvicorn with the issuer's JWKS endpoint holding every request: eight clients at once
    are each answered 503 within one fetch's timeout (they queued behind one another's
    fetches, 5 s each, 40 s for the last), and once the issuer answers again tokens work."""
    from tasks_app.oauth import JWKS_TIMEOUT

    port = free_port()
    url = f"http://127.0.0.1:{port}/mcp"
    processes.web(port, **issuer.env(url))
    token = issuer.sign(issuer.claims(url))
    issuer.mode = "hang"

    def send(_: int) -> tuple[int, float, httpx.Response]:
        began = time.monotonic()
        response = httpx.post(url, headers={"Authorization": f"Bearer {token}"}, json={}, timeout=120)
        return response.status_code, time.monotonic() - began, response

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(send, range(8)))
    for status, took, response in answers:
        assert status == 503 and took < JWKS_TIMEOUT + 3, (status, took, response.text[:200])
        assert int(response.headers["Retry-After"]) >= 1 and response.json()["error"]["code"] == -32003
    assert issuer.fetches <= 2
    issuer.mode = "ok"
    wait_until(
        lambda: httpx.post(url, headers={"Authorization": f"Bearer {token}"}, json={}).status_code != 503,
        timeout=30,
        what="the issuer's keys to be fetched again",
    )


def test_a_key_made_with_a_token_expires_with_it(configured, alice):
    """A stolen access token lives minutes; a key it made must not outlive it (nor the
    issuer's say over the user: signing them out there ends both)."""
    claims = configured.claims(AUDIENCE)
    client = Client(headers={"Authorization": f"Bearer {configured.sign(claims)}"})
    made = client.post("/runtime/keys", data={"name": "from a token"}, content_type="application/json")
    assert made.status_code == 201, made.content
    assert ApiKey.objects.get(prefix=made.json()["id"]).expires_at == datetime.fromtimestamp(claims["exp"], UTC)
    forever = client.post(
        "/runtime/keys", data={"name": "forever", "expiresAt": "2999-01-01T00:00:00Z"}, content_type="application/json"
    )
    assert forever.status_code == 400 and "outlive" in forever.json()["error"]["message"]
    far = configured.sign({**claims, "exp": 10**15})  # past year 9999: no datetime holds it
    assert Client(headers={"Authorization": f"Bearer {far}"}).get("/runtime/tasks").status_code == 200


def test_a_token_short_of_a_scope_is_told_which_one_to_ask_for(configured, alice, victor):
    """MCP authorization's scope challenge (RFC 6750 §3.1): a good token whose scopes fall short
    of what it asked is 403 with error="insufficient_scope" and the OAuth scope it needs, on
    /mcp, REST and SSE alike, so the client can ask its issuer for more (step-up) instead of
    guessing. Not when the membership falls short: no scope would help then."""
    task_id = mcp(alice.token, "tools/call", {"name": "noop", "arguments": {"steps": 1}}, name="noop").json()["result"][
        "taskId"
    ]
    operate = configured.sign(configured.claims(AUDIENCE, scope="runtime:operate"))
    as_operate = Client(headers={"Authorization": f"Bearer {operate}"})
    for edge, refused in (
        ("mcp tasks/get", mcp(operate, "tasks/get", {"taskId": task_id}, name=task_id)),
        ("rest detail", as_operate.get(f"/runtime/tasks/{task_id}")),
        ("rest list", as_operate.get("/runtime/tasks")),
        ("sse", as_operate.get(f"/runtime/tasks/{task_id}/events")),
    ):
        assert refused.status_code == 403, (edge, refused.content)
        challenge = refused.get("WWW-Authenticate", "")
        assert challenge.startswith("Bearer ") and 'error="insufficient_scope"' in challenge, (edge, challenge)
        assert 'scope="runtime:read"' in challenge, (edge, challenge)
        assert 'resource_metadata="http://testserver/.well-known/oauth-protected-resource"' in challenge
    reader = configured.sign(configured.claims(AUDIENCE, scope="runtime:read"))
    cancel = Client(headers={"Authorization": f"Bearer {reader}"}).post(
        f"/runtime/tasks/{task_id}/cancel", {}, content_type="application/json"
    )
    assert cancel.status_code == 403 and 'scope="runtime:operate"' in cancel["WWW-Authenticate"], cancel.content
    # victor is a viewer: a token with every scope still may not cancel, and is not sent to ask for more.
    capped = configured.sign(configured.claims(AUDIENCE, sub="victor", scope="runtime:admin"))
    refused = Client(headers={"Authorization": f"Bearer {capped}"}).post(
        f"/runtime/tasks/{task_id}/cancel", {}, content_type="application/json"
    )
    assert refused.status_code == 403 and "insufficient_scope" not in refused.get("WWW-Authenticate", "")
    # An API key short of a scope is told the key scope it lacks.
    from tests.test_scope_rules import scoped_keys

    blind = scoped_keys("operator", "oscar", ["operate"])["operate"]
    refused = Client(headers={"Authorization": f"Bearer {blind}"}).get(f"/runtime/tasks/{task_id}")
    assert refused.status_code == 403 and 'scope="read"' in refused["WWW-Authenticate"], refused.headers


def test_a_recheck_that_cannot_read_the_issuer_ends_the_stream_unavailable_never_as_revoked(configured, alice):
    """A long-lived stream asks again every stream.auth_recheck_seconds whether its token still
    works. When the issuer's keys cannot be read (the issuer stopped, and this process holds no
    key the token names), that is no verdict on the token: the SSE stream ends with an
    "unavailable" event and an /mcp wait with -32003, each naming the issuer, so the client
    keeps its token and reconnects. It used to end them as revoked (the token thrown away)."""
    from django.test import RequestFactory

    from mcp_server.views import Recheck
    from tasks_app.api import sse
    from tasks_app.auth import authenticate_token

    token = configured.sign(configured.claims(AUDIENCE))  # its issuer never asked yet: no key cached
    configured.close()  # the issuer stops: its JWKS is refused
    with pytest.raises(httpx.ConnectError):
        httpx.get(configured.jwks_uri, timeout=2)

    credential = sse.Credential(token, None, None, alice.tenant.pk)
    verdict = sse._judge([credential])[credential]
    assert verdict == ("unavailable", "the token issuer is unreachable"), verdict
    last = sse.unavailable_event(verdict[1])
    assert last.startswith("retry: ") and "event: unavailable\n" in last
    assert "the token issuer is unreachable; retry shortly" in last

    request = RequestFactory().post("/mcp", headers={"Authorization": f"Bearer {token}"})
    recheck = Recheck(request, authenticate_token(alice.token)[1])
    recheck.due = 0.0  # the recheck is due now
    refused = asyncio.run(recheck.refusal())
    assert refused is not None and refused.code == -32003 and refused.http_status == 503, refused
    assert "the token issuer is unreachable" in refused.message


def test_a_stream_whose_issuer_fails_goes_on_with_the_keys_it_published_last(issuer, alice, processes: Processes):
    """uvicorn, a JWT's event stream rechecked every second, the keys fetched again at every
    recheck (jwks_cache_seconds 0): the issuer then fails every fetch. Its keys fetched before
    go on verifying the token (tasks_app.oauth), so the stream reads on: neither ended as
    revoked nor cut by an error."""
    from conftest import SseClient
    from tasks_app.tests.test_engine import new_task

    port = free_port()
    url = f"http://127.0.0.1:{port}/mcp"
    processes.web(port, **{**issuer.env(url), "OAUTH_JWKS_CACHE_SECONDS": "0", "STREAM_AUTH_RECHECK_SECONDS": "1"})
    task = new_task(alice, steps=3)  # no worker: the stream only waits
    stream = SseClient(f"http://127.0.0.1:{port}/runtime/tasks/{task.id}/events", issuer.sign(issuer.claims(url)))
    wait_until(lambda: stream.events, timeout=20, what="the stream to open with its snapshot")
    issuer.mode = "error"
    failed_from = issuer.fetches
    wait_until(lambda: issuer.fetches >= failed_from + 2, timeout=30, what="two rechecks to ask the failing issuer")
    assert stream.live and stream.status == 200
    assert [e["type"] for e in stream.events] == ["task.snapshot"]
    stream.close()
