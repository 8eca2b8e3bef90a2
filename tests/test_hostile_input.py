"""Hostile input on every edge (issue 12): NUL characters, lone surrogates, NaN and Infinity,
JSON nested thousands deep, integers beyond bigint, non-UTF-8 bodies, malformed query strings,
headers and event ids. Each is a 4xx in the edge's error shape naming the problem (on /mcp a
JSON-RPC error echoing the request's id when it can be read), nothing is written, and the
process answers normally afterwards. Django's test client: the subject is the web process's
answer to bytes (common/json_safety.py is the one check behind every edge)."""

from __future__ import annotations

import base64
import json
import uuid
from typing import Any

import pytest
from django.test import Client

from mcp_server.protocol import MODERN, TASKS_EXT
from steering_app.models import InputRequest, SteeringCommand
from tasks_app.access import console
from tasks_app.actions import do_create_task
from tasks_app.models import AuditRecord, Task, TaskEvent
from tasks_app.streams.publish import channel_for

pytestmark = pytest.mark.django_db

# Raw JSON values a client can send and PostgreSQL (or the parser) cannot take.
HOSTILE = {
    "NUL in a string": '"a\\u0000b"',
    "NUL in a key": '{"k\\u0000": 1}',
    "lone surrogate": '"\\ud800"',
    "lone surrogate in a key": '{"\\udfff": 1}',
    "NaN": "NaN",
    "-Infinity": "-Infinity",
    "a number beyond a float": "1e400",
    "an integer beyond bigint": "9223372036854775808",
    # what the OpenAPI document declares for every number (a contract fuzzer sent it to cancel)
    "a float beyond bigint": "-1.7976931348623157e+308",
    "a 5,000-digit integer": "9" * 5000,
    "arrays nested 10,000 deep": "[" * 10_000 + "]" * 10_000,
    "objects nested 2,000 deep": '{"a":' * 2000 + "1" + "}" * 2000,
    "arrays nested 101 deep": "[" * 101 + "]" * 101,
    # the parser kept the last: what the client meant by the first was silently dropped
    "a key given twice": '{"k": 1, "k": 2}',
    "a key given twice, escaped once": '{"k": 1, "\\u006b": 1}',
}
# Nested past what the parser itself can take: refused as a whole document, no field to name.
UNPARSEABLE = {"arrays nested 10,000 deep", "objects nested 2,000 deep"}


def written() -> tuple[int, ...]:
    """Every row a refused request could have half-created."""
    return (
        Task.objects.count(),
        SteeringCommand.objects.count(),
        AuditRecord.objects.count(),
        TaskEvent.objects.count(),
        InputRequest.objects.filter(status="answered").count(),
    )


def client() -> Client:
    return Client(raise_request_exception=False)  # a 500 is an answer to assert on, not an exception


def refusal(response: Any, status: int = 400) -> dict[str, Any]:
    """The API's one error shape, with a message, and no 5xx."""
    assert response.status_code == status, (response.status_code, response.content[:400])
    error = response.json()["error"]
    assert set(error) <= {"code", "message", "fields"} and error["code"] and error["message"], error
    return error


@pytest.fixture
def task(alice) -> Task:
    """A task with an open question whose answer schema takes anything, so an answer reaches the database."""
    task, _ = do_create_task(console(alice.tenant, f"user:{alice.user.pk}"), agent="noop", input={"steps": 3})
    InputRequest.objects.create(
        tenant=alice.tenant, task=task, key="q", prompt="anything?", answer_schema={}, step_sequence=1
    )
    return task


def rest_edges(task: Task) -> dict[str, tuple[str, str, str]]:
    """edge → (path, body with @ where the hostile value goes, the field path of @)."""
    base = f"/runtime/tasks/{task.id}"
    return {
        "create": (
            "/runtime/tasks",
            '{"agent": "tool_calls", "input": {"calls": [{"tool": "http.request", "args": {"v": @}}]}}',
            "input.calls[0].args.v",
        ),
        "steering": (
            f"{base}/steering",
            '{"commandId": "c-1", "type": "adjust_goal", "expectedVersion": 1, "payload": {"goal": @}}',
            "payload.goal",
        ),
        "inputs": (f"{base}/inputs/q", '{"answer": @}', "answer"),
        "cancel": (f"{base}/cancel", '{"reason": @}', "reason"),
    }


def post_json(path: str, body: bytes | str, token: str, **headers: str) -> Any:
    return client().post(
        path, data=body, content_type="application/json", HTTP_AUTHORIZATION=f"Bearer {token}", **headers
    )


@pytest.mark.parametrize("edge", ["create", "steering", "inputs", "cancel"])
def test_every_rest_body_edge_refuses_each_hostile_value_naming_the_field(alice, task, edge):
    path, template, field = rest_edges(task)[edge]
    before = written()
    for name, value in HOSTILE.items():
        error = refusal(post_json(path, template.replace("@", value), alice.token))
        named = "body" if name in UNPARSEABLE else field
        assert any(key.startswith(named) for key in error.get("fields", {})), (name, error)
    for name, body in {
        "non-UTF-8": template.replace("@", '"\xff\xfe"').encode("latin-1"),
        "not JSON": template.replace("@", "'single quotes'"),
    }.items():
        assert refusal(post_json(path, body, alice.token))["code"] == "invalid_json", name
    assert written() == before
    # the process stays healthy: the same edge takes a good body
    good = post_json(path, template.replace("@", '"fine"' if edge != "create" else "{}"), alice.token)
    assert good.status_code in (201, 202), good.content


def test_a_key_given_twice_in_one_object_is_refused_naming_it_on_every_json_edge(alice, task):
    """{"agent": "a", "agent": "b"} was read as "b": the last one won, and what the client
    meant by the first was dropped without a word."""
    before = written()
    cases = {
        "/runtime/tasks": ('{"agent": "noop", "input": {"steps": 1}, "agent": "tool_calls"}', "agent"),
        f"/runtime/tasks/{task.id}/steering": (
            '{"commandId": "c-1", "type": "pause", "expectedVersion": 1, "type": "cancel"}',
            "type",
        ),
        f"/runtime/tasks/{task.id}/inputs/q": ('{"answer": {"a": 1, "b": 2, "a": 3}}', "answer.a"),
    }
    for path, (body, field) in cases.items():
        error = refusal(post_json(path, body, alice.token))
        assert list(error["fields"]) == [field] and "2 times" in error["message"], (path, error)
    assert written() == before


def test_rest_query_strings_are_checked(alice, task):
    api = alice.client()

    def cursor(raw: str) -> str:
        return base64.b64encode(raw.encode()).decode()

    cases = {
        "?status=%00": "query.status",
        "?status=working%00": "query.status",
        "?x%00=1": "query",
        "?cursor=garbage": "cursor",
        # not base64 at all: DRF's lenient decoding dropped every character and read a first page
        "?cursor=%25%25%25": "cursor",
        "?cursor=": "cursor",
        "?cursor=!!!!": "cursor",
        f"?cursor={cursor('p=2026-01-01T00:00:00')}***": "cursor",
        # base64 of what no page link carries: another key, a key twice, a direction other than 1
        f"?cursor={cursor('x=1')}": "cursor",
        f"?cursor={cursor('o=1&o=2')}": "cursor",
        f"?cursor={cursor('r=7')}": "cursor",
        f"?cursor={cursor('')}": "cursor",
        f"?cursor={cursor('p=garbage')}": "cursor",
        f"?cursor={cursor('p=2026-13-45 10:00:00')}": "cursor",
        f"?cursor={cursor('o=1&p=' + chr(0))}": "cursor",
        # Python parses it; in UTC it is past year 9999 (PostgreSQL refused its offset: a 500)
        f"?cursor={cursor('p=9999-12-31T23:59:59.999999-23:59')}": "cursor",
        "?limit=abc": "limit",
        "?limit=0": "limit",
        "?limit=-1": "limit",
        "?limit=" + "9" * 5000: "limit",
        # a parameter given twice: the view read one of them (the last), and the other was ignored
        "?status=working&status=queued": "query.status",
        "?status=working&status=working": "query.status",
        "?limit=1&limit=2": "query.limit",
        f"?cursor={cursor('o=1')}&cursor={cursor('o=2')}": "query.cursor",
        "?format=json&format=json": "query.format",
    }
    before = written()
    for query, field in cases.items():
        error = refusal(api.get(f"/runtime/tasks{query}"))
        assert field in error["message"] or field in str(error.get("fields")), (query, error)
    assert written() == before
    assert api.get("/runtime/tasks?limit=1000").status_code == 200  # more than a page holds: a full page
    # an instant, with an offset Python takes and PostgreSQL did not (beyond 15:59): a 500 before
    assert api.get(f"/runtime/tasks?cursor={cursor('p=2026-01-01T00:00:00-16:00')}").status_code == 200
    page = api.get("/runtime/tasks?limit=1").json()
    assert page["results"] and api.get(page["next"] or "/runtime/tasks").status_code == 200


@pytest.mark.parametrize("listing", ["audit", "checkpoints", "steering", "artifacts", "keys"])
def test_listings_that_are_not_paged_refuse_limit_and_cursor_naming_them(alice, task, listing):
    """Only /runtime/tasks pages; the other listings answer every record at once. A paging
    parameter there was ignored, so ?limit=-5 and ?limit=10 both read as honoured."""
    api = alice.client()
    path = "/runtime/keys" if listing == "keys" else f"/runtime/tasks/{task.id}/{listing}"
    for query, name in (("limit=-5", "limit"), ("limit=abc", "limit"), ("limit=10", "limit"), ("cursor=zzz", "cursor")):
        error = refusal(api.get(f"{path}?{query}"))
        assert list(error["fields"]) == [name] and "not paged" in error["message"], (query, error)
    assert api.get(path).status_code == 200


@pytest.mark.parametrize("number", ["1e308", "-2.5e19", "9.3e18"])
def test_a_float_out_of_range_is_refused_as_a_number_not_an_integer(alice, task, number):
    error = refusal(post_json(f"/runtime/tasks/{task.id}/inputs/q", f'{{"answer": {number}}}', alice.token))
    assert error["fields"] == {
        "answer": (
            f"a number outside {-(2**63)}..{2**63 - 1}, which every number must keep to (with a fraction or an exponent too)"
        )
    }, error


def test_a_parameter_given_twice_is_refused_naming_it_on_every_edge(alice, task):
    browser = client()
    browser.force_login(alice.user)
    for response, name in (
        (alice.client().get(f"/runtime/tasks/{task.id}/audit?x=1&x=2"), "x"),
        (alice.client().get(f"/runtime/tasks/{task.id}?limit=1&limit=1"), "limit"),
        (browser.get("/dashboard/tasks.json?status=queued&status=working"), "status"),
        (client().get("/runtime/schema?format=json&format=yaml"), "format"),
        (client().get("/healthz?a=1&a=1"), "a"),
    ):
        error = refusal(response)
        assert list(error["fields"]) == [f"query.{name}"] and "2 times" in error["message"], error
    assert browser.get("/dashboard/tasks.json?status=queued").status_code == 200


def test_a_charset_nobody_knows_is_refused_naming_it(alice, task):
    """Django drops a charset it cannot look up and reads the body as UTF-8: the task was
    created as if the header had said nothing."""
    body = b'{"agent": "noop", "input": {"steps": 1}}'
    before = written()

    def post(charset: str):
        return client().generic(
            "POST",
            "/runtime/tasks",
            body,
            content_type=f"application/json; charset={charset}",
            HTTP_AUTHORIZATION=f"Bearer {alice.token}",
        )

    for charset in ("bogus", "utf-9", "x" * 50):
        error = refusal(post(charset), 415)
        assert error["code"] == "unsupported_media_type" and repr(charset) in error["message"], error
    assert written() == before
    for charset in ("utf-8", "UTF-8"):
        response = post(charset)
        assert response.status_code == 201, response.content


def test_a_body_its_charset_cannot_decode_is_a_400_naming_the_charset(alice):
    """punycode (or idna) is a codec Python knows, but decoding fails with a UnicodeError that
    is no UnicodeDecodeError: it was a 500."""
    body = b'{"agent": "noop", "input": {"steps": 1}}'
    for charset in ("punycode", "idna"):
        response = client().generic(
            "POST",
            "/runtime/tasks",
            body if charset == "punycode" else b"\xff" + body,
            content_type=f"application/json; charset={charset}",
            HTTP_AUTHORIZATION=f"Bearer {alice.token}",
        )
        error = refusal(response)
        assert error["code"] == "invalid_json" and charset in error["message"], error
    assert Task.objects.count() == 0


def test_a_negative_or_zero_ttl_is_refused_naming_it(alice):
    for ttl in (-1, 0, -(2**40)):
        body = json.dumps({"agent": "noop", "input": {"steps": 1}, "ttlSeconds": ttl})
        error = refusal(post_json("/runtime/tasks", body, alice.token))
        assert list(error["fields"]) == ["ttlSeconds"], error
    assert Task.objects.count() == 0


def test_paths_and_headers_carrying_nul_or_malformed_keys_are_refused(alice, task):
    before = written()
    # a NUL in the path: the input key lands in a query on the way to the answer
    refusal(post_json(f"/runtime/tasks/{task.id}/inputs/q%00", '{"answer": 1}', alice.token))
    # Authorization: checked before any lookup (a NUL or surrogate in it was a 500)
    for header in (f"Bearer rt_{chr(0)}_x", "Bearer rt_0123456789ab_" + chr(0xD800) * 20, "Bearer x" * 300):
        response = client().get("/runtime/tasks", HTTP_AUTHORIZATION=header)
        assert response.status_code in (400, 401), (header[:30], response.content)
        refusal(response, response.status_code)
    # Idempotency-Key: "$" in its pattern let a trailing newline in
    body = '{"agent": "noop", "input": {"steps": 3}}'
    for key in ("k\n", "k" + chr(0)):
        error = refusal(post_json("/runtime/tasks", body, alice.token, HTTP_IDEMPOTENCY_KEY=key))
        assert "Idempotency-Key" in error["message"], error
    # a session cookie with a NUL in it (the session lookup queries with it)
    refusal(client().get("/dashboard/", HTTP_COOKIE="sessionid=" + "a" * 31 + chr(0)))
    assert written() == before


# "%zz" is no percent-encoding; "%ff" and "%c3%28" decode to bytes that are not UTF-8. Django
# read each as U+FFFD (or kept "%zz" as it came) and went on with a value the client never sent.
BAD_ENCODINGS = {"%zz": "percent-encoding", "%f": "percent-encoding", "%ff": "UTF-8", "%c3%28": "UTF-8"}


# the MCP view closes its connection, which would end a test transaction
@pytest.mark.django_db(transaction=True)
def test_bad_percent_encoding_in_a_query_string_or_a_form_is_refused_naming_the_parameter(alice, task):
    browser = client()
    browser.force_login(alice.user)
    form = "application/x-www-form-urlencoded"
    before = written()
    for bad, problem in BAD_ENCODINGS.items():
        for name, response, field in (
            ("REST list", alice.client().get(f"/runtime/tasks?status={bad}"), "query.status"),
            ("REST detail", alice.client().get(f"/runtime/tasks/{task.id}?x{bad}=1"), "query.x"),
            (
                "REST create, a form",
                client().post(
                    "/runtime/tasks", f"agent={bad}", content_type=form, HTTP_AUTHORIZATION=f"Bearer {alice.token}"
                ),
                "form.agent",
            ),
            ("dashboard", browser.get(f"/dashboard/tasks.json?status={bad}"), "query.status"),
            (
                "dashboard form",
                browser.post(f"/dashboard/tasks/{task.id}/steer", f"type=pause&command_id=c{bad}", content_type=form),
                "form.command_id",
            ),
            (
                "admin sign-in",
                client().post("/admin/login/", f"username=root{bad}&password=pw", content_type=form),
                "form.username",
            ),
        ):
            error = refusal(response)
            assert problem in error["message"], (name, bad, error)
            # the name as far as it decodes ("x%zz", "x\ufffd"): where the client can find it
            assert [key[: len(field)] for key in error["fields"]] == [field], (name, bad, error)
        message = rpc_error(mcp(alice.token, tools_call("1", modern=False), QUERY_STRING=f"x={bad}"), -32600, 7)
        assert "query.x" in message and problem in message, (bad, message)
    assert written() == before
    assert alice.client().get("/runtime/tasks?status=qu%65ued").status_code == 200  # well-formed: as before


def test_dashboard_query_strings_are_checked(alice, task):
    browser = client()
    browser.force_login(alice.user)
    for path in ("/dashboard/", "/dashboard/tasks.json"):
        for query, needle in (("?status=%00", "query.status"), ("?status=sleeping", "sleeping")):
            assert needle in refusal(browser.get(path + query))["message"]
        assert browser.get(path + "?status=queued").status_code == 200


def test_a_dashboard_form_with_a_number_beyond_bigint_starts_and_steers_nothing(alice, task):
    browser = client()
    browser.force_login(alice.user)
    before = written()
    started = browser.post(
        "/dashboard/tasks/new",
        {
            "tenant": alice.tenant.slug,
            "corpus": "corpora/demo",
            "goal": "g",
            "limit": str(2**64),
            "batch_size": "20",
            "pacing_ms": "0",
            "priority": "5",
            "idempotency_key": "dash-k",
        },
    )
    assert started.status_code == 303 and started["Location"] == "/dashboard/tasks/new", started
    steered = browser.post(
        f"/dashboard/tasks/{task.id}/steer", {"type": "pause", "expected_version": str(2**64), "command_id": "dash-c"}
    )
    assert steered.status_code == 303, steered
    assert written() == before


# the SSE view closes its connection, which would end a test transaction
@pytest.mark.django_db(transaction=True)
def test_the_event_stream_refuses_malformed_last_event_ids(alice, task):
    def stream(query: str = "", **headers: str) -> Any:
        return client().get(
            f"/runtime/tasks/{task.id}/events{query}", HTTP_AUTHORIZATION=f"Bearer {alice.token}", **headers
        )

    for bad in ("garbage", "a:b:c", "chan:-1", "chan:" + "9" * 30, "chan:1,", ":1", "chan:1" + chr(0), " "):
        error = refusal(stream(HTTP_LAST_EVENT_ID=bad))
        assert "Last-Event-ID" in error["message"] or "Last-Event-Id" in error["message"], (bad, error)
        assert "lastEventId" in refusal(stream(f"?lastEventId={bad.replace(chr(0), '%00')}"))["message"], bad
    # django-eventstream's own query parameters are not ours to honour (each was a 500)
    for query in ("?es-meta=garbage", "?recover=true", "?link=next"):
        assert stream(query).status_code == 200, query
    # Well-formed, but not an id this task's stream sent: another task's, another deployment's,
    # or beyond the task's last event
    own, last = channel_for(task.id), Task.objects.get(id=task.id).event_seq
    for bad, problem in (
        (f"{channel_for(uuid.uuid4())}:1", "another task"),
        (f"rt.task-{task.id}:0", "another task"),
        (f"{own}:0,{channel_for(uuid.uuid4())}:0", "another task"),
        (f"{own}:{last + 1}", "beyond"),
        (f"{own}:" + "9" * 18, "beyond"),
    ):
        for name, response in (
            ("Last-Event-ID", stream(HTTP_LAST_EVENT_ID=bad)),
            ("lastEventId", stream(f"?lastEventId={bad}")),
        ):
            error = refusal(response)
            assert list(error["fields"]) == [name] and problem in error["message"], (bad, error)
    assert stream(HTTP_LAST_EVENT_ID=f"{own}:{last}").status_code == 200  # what a browser sends back
    Task.objects.filter(id=task.id).update(event_seq=last + 5)  # five events later
    for seen in (0, last + 1, last + 5):
        assert stream(HTTP_LAST_EVENT_ID=f"{own}:{seen}").status_code == 200, seen
    beyond = refusal(stream(HTTP_LAST_EVENT_ID=f"{own}:{last + 6}"))
    assert f"beyond this task's last event ({last + 5})" in beyond["message"], beyond


# --- /mcp, both wires ----------------------------------------------------------------------

META = {
    "io.modelcontextprotocol/protocolVersion": MODERN,
    "io.modelcontextprotocol/clientCapabilities": {"extensions": {TASKS_EXT: {}}},
}


def mcp(token: str, body: bytes | str, *, modern: str | None = None, **headers: str) -> Any:
    """POST /mcp; modern: the method, sent as the 2026-07-28 wire's headers."""
    extra = {"HTTP_ACCEPT": "application/json, text/event-stream", "HTTP_AUTHORIZATION": f"Bearer {token}", **headers}
    if modern:
        extra.update(HTTP_MCP_PROTOCOL_VERSION=MODERN, HTTP_MCP_METHOD=modern, HTTP_MCP_NAME="tool_calls")
    return client().post("/mcp", data=body, content_type="application/json", **extra)


def rpc_error(response: Any, code: int, request_id: Any) -> str:
    assert response.status_code < 500, (response.status_code, response.content[:400])
    body = response.json()
    assert (body["jsonrpc"], body["id"], body["error"]["code"]) == ("2.0", request_id, code), body
    return body["error"]["message"]


def tools_call(arguments: str, *, modern: bool) -> str:
    meta = json.dumps(META) if modern else "{}"
    task = "" if modern else ', "task": {}'
    return (
        '{"jsonrpc": "2.0", "id": 7, "method": "tools/call", "params": {"_meta": '
        + meta
        + ', "name": "tool_calls"'
        + task
        + ', "arguments": {"calls": [{"tool": "t", "args": {"v": '
        + arguments
        + "}}]}}}"
    )


# the MCP view closes its connection, which would end a test transaction
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("modern", [True, False], ids=["2026-07-28", "2025-11-25"])
def test_mcp_refuses_each_hostile_value_echoing_the_request_id(alice, task, modern):
    before = written()
    wire = {"modern": "tools/call"} if modern else {}
    for name, value in HOSTILE.items():
        response = mcp(alice.token, tools_call(value, modern=modern), **wire)
        if name in UNPARSEABLE:  # refused as a whole, the id (read without parsing) echoed
            assert "nested" in rpc_error(response, -32600, 7), name
        else:
            assert "params.arguments.calls[0].args.v" in rpc_error(response, -32602, 7), name
    # so deep it cannot be parsed, the id after it: still read and echoed
    deep = '{"jsonrpc": "2.0", "method": "tools/call", "params": ' + "[" * 5000 + "]" * 5000 + ', "id": "r-9"}'
    rpc_error(mcp(alice.token, deep, **wire), -32600, "r-9")
    rpc_error(mcp(alice.token, tools_call('"\xff"', modern=modern).encode("latin-1"), **wire), -32700, None)
    rpc_error(mcp(alice.token, '{"jsonrpc": "2.0", "id": NaN, "method": "tools/list"}', **wire), -32600, None)
    rpc_error(
        mcp(alice.token, '{"jsonrpc": "2.0", "id": 8, "method": "tools/call\\u0000", "params": {}}', **wire), -32600, 8
    )
    rpc_error(mcp(alice.token, '{"jsonrpc": "2.0", "id": 9, "method": "tools/call", "params": [1]}', **wire), -32602, 9)
    # a hostile header is refused like the body's content, with the id
    rpc_error(mcp(alice.token, tools_call("1", modern=modern), HTTP_X_NOTE="a" + chr(0), **wire), -32600, 7)
    # an API key that could not be ours is a 401 before any lookup (a NUL in it was a 500)
    refused = mcp("rt_" + chr(0) + "_x", tools_call("1", modern=modern), **wire)
    assert refused.status_code == 401 and refused.json()["id"] == 7, refused.content
    assert written() == before
    # the process stays healthy: a good call starts a task
    assert mcp(alice.token, tools_call("{}", modern=modern), **wire).status_code == 200
    assert Task.objects.count() == before[0] + 1


# the MCP view closes its connection, which would end a test transaction
@pytest.mark.django_db(transaction=True)
def test_a_legacy_tasks_list_cursor_beyond_bigint_is_invalid_params(alice, task):
    encoded = [base64.urlsafe_b64encode(o.encode()).decode() for o in ("9" * 30, str(2**63), "-1", "x", " 1", "1_0")]
    # not base64 (decoded leniently, "%%%" was nothing at all), or not a string
    for cursor in (*encoded, "%%%", "", "MQ", 1, ["MQ=="], True):
        body = json.dumps({"jsonrpc": "2.0", "id": 3, "method": "tasks/list", "params": {"cursor": cursor}})
        assert "cursor" in rpc_error(mcp(alice.token, body), -32602, 3), cursor
    listed = mcp(alice.token, json.dumps({"jsonrpc": "2.0", "id": 4, "method": "tasks/list", "params": {}}))
    assert [t["taskId"] for t in listed.json()["result"]["tasks"]] == [str(task.id)]


# --- the last line: the actions themselves -------------------------------------------------


def test_the_actions_refuse_what_no_edge_may_store(alice, task):
    """Whatever the caller (an edge, the admin, a script), nothing unstorable reaches a write."""
    from common.json_safety import UnsafeInput
    from steering_app.actions import do_answer_input, do_cancel_task, do_enqueue_command

    who = {"who": console(alice.tenant, "user:x")}
    before = written()
    calls = {
        "input with a NUL": lambda: do_create_task(
            console(alice.tenant, "user:x"), agent="tool_calls", input={"calls": [{"tool": "t", "args": {"v": "\x00"}}]}
        ),
        "a budget beyond bigint": lambda: do_create_task(
            console(alice.tenant, "user:x"), agent="noop", input={"steps": 3}, budget={"maxSteps": 2**70}
        ),
        "a goal with a surrogate": lambda: do_create_task(
            console(alice.tenant, "user:x"), agent="noop", input={"steps": 3}, goal="\udc00"
        ),
        "a payload with a NUL": lambda: do_enqueue_command(
            task.id,
            **who,
            command_id="c",
            type="adjust_goal",
            payload={"goal": "\x00"},
            expected_version=1,
        ),
        "a reason with a NUL": lambda: do_cancel_task(task.id, **who, reason="\x00"),
        "an answer of NaN": lambda: do_answer_input(task.id, **who, key="q", answer=float("nan")),
        "a key with a surrogate": lambda: do_answer_input(task.id, **who, key="\ud800", answer=1),
    }
    for name, call in calls.items():
        with pytest.raises(UnsafeInput):
            call()
        assert written() == before, name


def test_steering_refuses_a_command_id_of_the_wrong_shape_whatever_the_edge(alice, task):
    """The command id's shape is the action's to check (REST, MCP, the dashboard and the admin
    call it): one that is too long, has a space or a trailing newline is refused naming it,
    not cut to fit or stored as sent."""
    from steering_app.actions import do_enqueue_command
    from tasks_app.errors import InvalidCommand

    before = written()
    for command_id in ("x" * 65, "a b", "p1\n", "", "é"):
        with pytest.raises(InvalidCommand, match="commandId"):
            do_enqueue_command(
                task.id,
                who=console(alice.tenant, "user:x"),
                command_id=command_id,
                type="pause",
                payload={},
                expected_version=1,
            )
        assert written() == before, command_id


# --- the admin -----------------------------------------------------------------------------


@pytest.fixture
def staff(alice) -> Client:
    from django.contrib.auth import get_user_model

    signed_in = client()
    signed_in.force_login(get_user_model().objects.create_superuser("root", "root@example.com", "pw"))
    return signed_in


@pytest.mark.parametrize(
    "query",
    [
        "created_at__year=99999999999",
        "created_at__year=9999",
        "created_at__year=0",
        "created_at__year=9999&created_at__month=12",
        "created_at__year=2020&created_at__month=99999999999999999999",
        "created_at__year=2020&created_at__month=2&created_at__day=99999999999999999999",
    ],
)
def test_admin_changelist_dates_beyond_the_calendar_are_refused(staff, task, query):
    """The task list's date drill-down (date_hierarchy) with a year, month or day no date
    has: the admin's own answer to a bad filter (back to the list, ?e=1), not a 500."""
    response = staff.get(f"/admin/tasks_app/task/?{query}")
    assert response.status_code == 302 and response["Location"].endswith("?e=1"), response.status_code
    assert staff.get("/admin/tasks_app/task/").status_code == 200


@pytest.mark.parametrize("selected", ["not-a-uuid", "9" * 30])
def test_admin_actions_on_ids_that_are_not_tasks_change_nothing(staff, task, selected):
    before = written()
    response = staff.post(
        "/admin/tasks_app/task/", {"action": "cancel", "_selected_action": [selected], "apply": "1", "reason": "r"}
    )
    assert response.status_code < 500, response.status_code
    assert written() == before
