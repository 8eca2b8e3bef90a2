"""/mcp framing and validation: bad JSON-RPC gets the spec's error codes (never a 500),
headers and _meta are checked, Origin and Host guard against DNS rebinding, and every
method is authenticated and tenant-scoped. No worker needed: nothing here runs a task."""

from __future__ import annotations

import json
from typing import Any

import pytest
from django.test import Client

from mcp_server.protocol import MODERN, TASKS_EXT
from tasks_app.models import Task

pytestmark = pytest.mark.django_db(transaction=True)

META = {
    "io.modelcontextprotocol/protocolVersion": MODERN,
    "io.modelcontextprotocol/clientCapabilities": {"extensions": {TASKS_EXT: {}}},
}


def post(token: str | None, body: Any, *, raw: bytes | None = None, **headers: str):
    client = Client()
    extra = {"Accept": "application/json, text/event-stream", **headers}
    if token:
        extra["Authorization"] = f"Bearer {token}"
    data = raw if raw is not None else json.dumps(body)
    return client.post("/mcp", data=data, content_type="application/json", headers=extra)


def modern(token: str | None, method: str, params: dict | None = None, *, name: str | None = None, **headers: str):
    hdrs = {"MCP-Protocol-Version": MODERN, "Mcp-Method": method, **headers}
    if name is not None:
        hdrs["Mcp-Name"] = name
    return post(
        token, {"jsonrpc": "2.0", "id": 7, "method": method, "params": {"_meta": META, **(params or {})}}, **hdrs
    )


def error_of(response) -> int:
    return response.json()["error"]["code"]


def test_malformed_bodies_get_json_rpc_errors_never_500(alice):
    cases = [
        (post(alice.token, None, raw=b"{not json"), 400, -32700),
        (post(alice.token, [{"jsonrpc": "2.0", "id": 1, "method": "tools/list"}]), 400, -32600),
        (post(alice.token, {"jsonrpc": "1.0", "id": 1, "method": "tools/list"}), 400, -32600),
        (post(alice.token, {"jsonrpc": "2.0", "id": 1, "method": 5}), 400, -32600),
        (post(alice.token, {"jsonrpc": "2.0", "id": [1], "method": "tools/list"}), 400, -32600),
        (post(alice.token, {"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": [1]}), 400, -32602),
        (post(alice.token, None, raw=b'"a string"'), 400, -32600),
    ]
    for response, status, code in cases:
        assert response.status_code == status, response.content
        assert error_of(response) == code


def test_oversized_body_is_refused_before_parsing(alice, settings):
    settings.RUNTIME_MAX_BODY_BYTES = 1000
    response = post(alice.token, {"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {"x": "y" * 5000}})
    assert response.status_code == 413


def test_modern_wire_validation(alice):
    assert modern(alice.token, "nope/nope").status_code == 404
    assert error_of(modern(alice.token, "nope/nope")) == -32601
    for removed in ("initialize", "ping", "tasks/result", "tasks/list", "logging/setLevel"):
        response = modern(alice.token, removed)
        assert (response.status_code, error_of(response)) == (404, -32601), removed
    # missing _meta, or a required key of it
    response = post(
        alice.token,
        {"jsonrpc": "2.0", "id": 1, "method": "tools/list"},
        **{"MCP-Protocol-Version": MODERN, "Mcp-Method": "tools/list"},
    )
    assert (response.status_code, error_of(response)) == (400, -32602)
    response = post(
        alice.token,
        {
            "jsonrpc": "2.0",
            "id": 1,
            "method": "tools/list",
            "params": {"_meta": {"io.modelcontextprotocol/protocolVersion": MODERN}},
        },
        **{"MCP-Protocol-Version": MODERN, "Mcp-Method": "tools/list"},
    )
    assert (response.status_code, error_of(response)) == (400, -32602)
    # headers that disagree with the body
    assert error_of(modern(alice.token, "tools/list", **{"Mcp-Method": "tools/call"})) == -32020
    assert error_of(modern(alice.token, "tasks/get", {"taskId": "a"}, name="b")) == -32020
    assert error_of(modern(alice.token, "tasks/get", {"taskId": "a"})) == -32020
    # an unsupported version in header and body
    body = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "tools/list",
        "params": {"_meta": {**META, "io.modelcontextprotocol/protocolVersion": "2099-01-01"}},
    }
    response = post(alice.token, body, **{"MCP-Protocol-Version": "2099-01-01", "Mcp-Method": "tools/list"})
    assert (response.status_code, error_of(response)) == (400, -32022)
    assert response.json()["error"]["data"] == {"supported": [MODERN], "requested": "2099-01-01"}
    # base64 header form
    response = modern(alice.token, "tools/list", **{"Mcp-Method": "=?base64?dG9vbHMvbGlzdA==?="})
    assert response.status_code == 200


def test_discover_and_lists_are_cacheable_with_result_type(alice):
    found = modern(alice.token, "server/discover").json()["result"]
    assert found["resultType"] == "complete" and found["supportedVersions"] == [MODERN]
    assert found["capabilities"]["extensions"] == {TASKS_EXT: {}} and "tasks" not in found["capabilities"]
    assert found["_meta"]["io.modelcontextprotocol/serverInfo"]["name"]
    tools = modern(alice.token, "tools/list").json()["result"]
    assert tools["resultType"] == "complete" and tools["ttlMs"] >= 0 and tools["cacheScope"] in ("public", "private")
    names = [t["name"] for t in tools["tools"]]
    assert names[-6:] == ["pause_task", "resume_task", "cancel_task", "adjust_goal", "set_priority", "kill_task"]
    assert names[0] == "greet" and {"noop", "slow_compute"} <= set(names)  # synchronous tools first
    assert all("execution" not in t and t["inputSchema"]["type"] == "object" for t in tools["tools"])


def test_notifications_are_accepted_with_202(alice):
    response = post(
        alice.token,
        {"jsonrpc": "2.0", "method": "notifications/initialized", "params": {"_meta": META}},
        **{"MCP-Protocol-Version": MODERN, "Mcp-Method": "notifications/initialized"},
    )
    assert response.status_code == 202 and response.content == b""


def test_authentication_is_required_on_every_method(alice):
    for token in (None, "rt_nope_nope", alice.token + "x"):
        response = modern(token, "server/discover")
        assert response.status_code == 401
        assert response["WWW-Authenticate"].startswith("Bearer")
        assert "error" in response.json()


def test_a_viewer_may_read_but_not_start_or_cancel(victor):
    listed = modern(victor.token, "tools/list")
    assert listed.status_code == 200
    started = modern(
        victor.token, "tools/call", {"name": "slow_compute", "arguments": {"seconds": 1}}, name="slow_compute"
    ).json()["result"]
    assert started["isError"] is True and "operator" in started["content"][0]["text"]


def test_origin_and_host_guard_against_dns_rebinding(alice):
    assert modern(alice.token, "server/discover", Origin="http://evil.example.com").status_code == 403
    assert modern(alice.token, "server/discover", Origin="http://localhost:5173").status_code == 200
    assert modern(alice.token, "server/discover", Origin="http://127.0.0.1").status_code == 200
    # authenticated, so only the Host can be what refuses it
    response = Client().post(
        "/mcp",
        data="{}",
        content_type="application/json",
        HTTP_HOST="evil.example.com",
        headers={"Authorization": f"Bearer {alice.token}"},
    )
    assert response.status_code == 400


def test_an_origin_that_is_no_web_page_of_this_host_is_403_never_a_500(alice, settings):
    """An Origin is scheme://host[:port] of a web page. One that cannot be parsed (it was a
    500), is "null", names another scheme (a file, an extension), carries userinfo or a path,
    or is not this host, is refused; with ALLOWED_HOSTS "*" the Host header proves nothing
    (under DNS rebinding it is the attacker's name, as the Origin is), so only local and
    configured origins pass."""
    refused = [
        "http://[::1",
        "http://localhost:99999",
        "null",
        "file://localhost",
        "chrome-extension://localhost",
        "javascript://localhost",
        "http://a:b@127.0.0.1",
        "http://localhost/path",
        "http://localhost.evil.example.com",
        "https://evil.example.com",
    ]
    for origin in refused:
        response = modern(alice.token, "server/discover", Origin=origin)
        assert response.status_code == 403, (origin, response.status_code, response.content)
        assert response.json()["error"]["message"] == "Forbidden: Origin not allowed", origin
    for origin in ("http://testserver", "https://localhost:5173", "http://[::1]:3000"):
        assert modern(alice.token, "server/discover", Origin=origin).status_code == 200, origin
    settings.ALLOWED_HOSTS = ["*"]
    rebound = Client().post(
        "/mcp",
        data=json.dumps({"jsonrpc": "2.0", "id": 1, "method": "tools/list"}),
        content_type="application/json",
        HTTP_HOST="evil.example.com:8000",
        headers={"Authorization": f"Bearer {alice.token}", "Origin": "http://evil.example.com:8000"},
    )
    assert rebound.status_code == 403, rebound.content
    settings.RUNTIME_MCP_ALLOWED_ORIGINS = ["https://console.example.com"]
    allowed = modern(alice.token, "server/discover", Origin="https://console.example.com")
    assert allowed.status_code == 200


def test_get_and_delete_are_not_allowed_and_options_says_what_is(alice):
    for method in ("get", "delete", "put"):
        response = getattr(Client(), method)("/mcp", headers={"Authorization": f"Bearer {alice.token}"})
        assert response.status_code == 405 and response["Allow"] == "POST, OPTIONS", response
        assert response.json()["error"]["code"] == -32600, response.content
    asked = Client().options("/mcp")  # no credentials needed to learn the methods
    assert asked.status_code == 200 and asked["Allow"] == "POST, OPTIONS" and asked.content == b"", asked


def test_unknown_tool_and_bad_arguments(alice):
    response = modern(alice.token, "tools/call", {"name": "nope", "arguments": {}}, name="nope")
    assert (response.status_code, error_of(response)) == (400, -32602)
    response = modern(alice.token, "tools/call", {"name": "greet", "arguments": 3}, name="greet")
    assert (response.status_code, error_of(response)) == (400, -32602)
    bad = modern(
        alice.token, "tools/call", {"name": "slow_compute", "arguments": {"seconds": -1}}, name="slow_compute"
    ).json()["result"]
    assert bad["isError"] is True and bad["resultType"] == "complete"


def test_a_protocol_version_that_is_not_a_string_is_invalid_params(alice):
    """initialize's protocolVersion (2025 wire) and _meta's (2026 wire) are strings; 5, null
    or a list was answered with the server's own version as if none had been asked for."""
    for version in (5, None, ["2025-11-25"], {"v": 1}):
        params = {"protocolVersion": version, "capabilities": {}, "clientInfo": {"name": "c", "version": "1"}}
        answer = post(alice.token, {"jsonrpc": "2.0", "id": 3, "method": "initialize", "params": params}).json()
        assert (answer["id"], answer["error"]["code"]) == (3, -32602), (version, answer)
        assert "protocolVersion" in answer["error"]["message"], answer
        meta = {**META, "io.modelcontextprotocol/protocolVersion": version}
        body = {"jsonrpc": "2.0", "id": 4, "method": "tools/list", "params": {"_meta": meta}}
        response = post(alice.token, body, **{"MCP-Protocol-Version": MODERN, "Mcp-Method": "tools/list"})
        assert (response.status_code, error_of(response)) == (400, -32602), (version, response.content)
        assert "protocolVersion" in response.json()["error"]["message"]
    params = {"protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "c", "version": "1"}}
    answer = post(alice.token, {"jsonrpc": "2.0", "id": 5, "method": "initialize", "params": params}).json()
    assert answer["result"]["protocolVersion"] == "2025-11-25"


def test_a_task_ttl_that_is_negative_or_no_number_is_invalid_params(alice):
    """The 2025 wire's task.ttl (ms) was ignored when it was not a positive integer: the task
    started with the default TTL, as if the request had been fine."""
    for ttl in (-1, -60000, "60000", None, True):
        params = {"name": "tool_calls", "arguments": {"calls": []}, "task": {"ttl": ttl}}
        answer = post(alice.token, {"jsonrpc": "2.0", "id": 8, "method": "tools/call", "params": params}).json()
        assert (answer["id"], answer["error"]["code"]) == (8, -32602), (ttl, answer)
        assert "task.ttl" in answer["error"]["message"], answer
    assert Task.objects.count() == 0
    params = {"name": "tool_calls", "arguments": {"calls": []}, "task": {"ttl": 60000}}
    assert "result" in post(alice.token, {"jsonrpc": "2.0", "id": 9, "method": "tools/call", "params": params}).json()


def test_a_body_not_sent_as_json_is_415_naming_its_content_type(alice):
    """/mcp takes JSON-RPC as application/json (a charset, UTF-8, may follow). A body sent as
    anything else, or with no Content-Type, is refused naming what came: a JSON-RPC error, with
    the request's id when the body has one, and nothing done."""
    body = json.dumps({"jsonrpc": "2.0", "id": 6, "method": "tools/list"}).encode()

    def post_as(content_type: str, data: bytes = body) -> Any:
        return Client().generic(
            "POST",
            "/mcp",
            data,
            content_type=content_type,
            headers={"Accept": "application/json, text/event-stream", "Authorization": f"Bearer {alice.token}"},
        )

    refused = {
        "text/plain": body,
        "": body,
        "application/x-www-form-urlencoded": b"jsonrpc=2.0&id=6&method=tools%2Flist",
        "multipart/form-data; boundary=x": b"--x--",
        "application/jsonp": body,
        "application/json-seq": body,
        "text/json": body,
    }
    for content_type, data in refused.items():
        response = post_as(content_type, data)
        assert response.status_code == 415, (content_type, response.content)
        error = response.json()["error"]
        assert error["code"] == -32600 and "Content-Type" in error["message"], error
        media_type = content_type.split(";")[0]
        assert (repr(media_type) if media_type else "no Content-Type") in error["message"], error
        assert response.json()["id"] == (6 if data == body else None)
    for content_type in ("application/json", "application/json; charset=utf-8", "Application/JSON"):
        ok = post_as(content_type)
        assert ok.status_code == 200, (content_type, ok.content)


def test_a_charset_other_than_utf8_is_refused_naming_it(alice):
    """Django drops a charset it cannot look up and reads the body as UTF-8: the request went
    on as if the header had said nothing. /mcp reads UTF-8 only, so a charset it could look
    up (rot13, punycode, Latin-1) was read as UTF-8 all the same: refused too."""
    body = json.dumps({"jsonrpc": "2.0", "id": 6, "method": "tools/list"}).encode()

    def post_in(charset: str) -> Any:
        return Client().generic(
            "POST",
            "/mcp",
            body,
            content_type=f"application/json; charset={charset}",
            headers={"Accept": "application/json, text/event-stream", "Authorization": f"Bearer {alice.token}"},
        )

    for charset in ("bogus", "rot13", "punycode", "latin-1", "utf-16", "utf-8-sig"):
        response = post_in(charset)
        assert response.status_code == 415, (charset, response.content)
        error = response.json()["error"]
        assert response.json()["id"] == 6 and charset in error["message"] and error["code"] == -32600, error
    for charset in ("utf-8", "UTF-8", "utf8"):
        ok = post_in(charset)
        assert ok.status_code == 200, (charset, ok.content)
