"""Property-based: Hypothesis generates hostile JSON, bodies and strings for every edge (REST
bodies, list and dashboard query strings, headers, SSE event ids, /mcp on both wires) and
each answer must be below 500, refusals in the edge's error shape, and a refusal must have
written nothing. Deterministic (derandomize, no example database) and bounded, for CI."""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from typing import Any
from urllib.parse import quote

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.test_hostile_input import META, client, task, written  # noqa: F401 (task: the fixture)

pytestmark = pytest.mark.django_db(transaction=True)

PROPERTIES = settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    database=None,
    # one persona and task serve every example: a refused request changes nothing, which is the point
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
)

# --- hostile JSON, as text: a tree of ordinary values with hostile ones among its leaves ----

UNSAFE_CHARS = st.one_of(st.just("\x00"), st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF))
HOSTILE_TEXT = st.builds(lambda a, bad, b: a + bad + b, st.text(max_size=6), UNSAFE_CHARS, st.text(max_size=6))


def deep(n: int, kind: str) -> str:
    return "[" * n + "]" * n if kind == "array" else '{"a":' * n + "0" + "}" * n


Doc = tuple[str, bool]  # (JSON text, holds something hostile)

ORDINARY: st.SearchStrategy[Doc] = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**63 - 1),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=12),
).map(lambda value: (json.dumps(value), False))
HOSTILE: st.SearchStrategy[Doc] = st.one_of(
    st.sampled_from(["NaN", "Infinity", "-Infinity", "1e400", "-1e999", "1" * 5000]),
    st.one_of(st.integers(min_value=2**63), st.integers(max_value=-(2**63) - 1)).map(str),
    HOSTILE_TEXT.map(json.dumps),  # json.dumps escapes them: \u0000, \ud800 on the wire
    # past our limit (100), and past what the parser itself can take (about 1,500)
    st.builds(deep, st.sampled_from([101, 999, 2_000, 10_000]), st.sampled_from(["array", "object"])),
).map(lambda text: (text, True))
KEYS: st.SearchStrategy[Doc] = st.one_of(
    st.text(max_size=8).map(lambda k: (json.dumps(k), False)), HOSTILE_TEXT.map(lambda k: (json.dumps(k), True))
)


def _array(items: list[Doc]) -> Doc:
    return "[" + ",".join(text for text, _ in items) + "]", any(bad for _, bad in items)


def _object(members: list[tuple[Doc, Doc]]) -> Doc:
    text = "{" + ",".join(f"{key}:{value}" for (key, _), (value, _) in members) + "}"
    return text, any(k_bad or v_bad for (_, k_bad), (_, v_bad) in members)


TREES = st.recursive(
    st.one_of(ORDINARY, HOSTILE),
    lambda children: st.one_of(
        st.lists(children, max_size=4).map(_array), st.lists(st.tuples(KEYS, children), max_size=4).map(_object)
    ),
    max_leaves=8,
)
HOSTILE_JSON = TREES.filter(lambda doc: doc[1]).map(lambda doc: doc[0])
# What a body may be: hostile JSON in the hole of the edge's template, or any bytes at all.
BODIES = st.one_of(HOSTILE_JSON.map(lambda doc: ("hole", doc)), st.binary(max_size=64).map(lambda b: ("raw", b)))

# Strings for query parameters and headers: anything, NULs and surrogates included.
STRINGS = st.text(st.one_of(st.characters(exclude_categories=()), st.sampled_from(":,%\n\x00")), max_size=40)


# --- the edges ------------------------------------------------------------------------------


def rest_templates(task_id: str) -> dict[str, list[tuple[str, str]]]:
    base = f"/runtime/tasks/{task_id}"
    return {
        "create": [
            ("/runtime/tasks", t)
            for t in (
                '{"agent": "tool_calls", "input": {"calls": [{"tool": "t", "args": {"v": @}}]}}',
                '{"agent": "noop", "input": {"steps": 3}, "budget": @}',
                '{"agent": "noop", "input": @}',
                '{"agent": "noop", "input": {"steps": 3}, "priority": @, "goal": @}',
                "@",
            )
        ],
        "steering": [
            (f"{base}/steering", t)
            for t in (
                '{"commandId": "c-1", "type": "adjust_goal", "expectedVersion": 1, "payload": @}',
                '{"commandId": "c-3", "type": "adjust_goal", "expectedVersion": 1, "payload": {"goal": @}}',
                '{"commandId": @, "type": "set_priority", "expectedVersion": @, "payload": {"priority": @}}',
                '{"commandId": "c-2", "type": "pause", "expectedVersion": 1, "reason": @}',
                "@",
            )
        ],
        "inputs": [(f"{base}/inputs/q", t) for t in ('{"answer": @}', '{"answer": 1, "reason": @}', "@")],
        "cancel": [(f"{base}/cancel", t) for t in ('{"reason": @}', "@")],
    }


MCP_TEMPLATES = [
    (
        "tools/call",
        '{"jsonrpc": "2.0", "id": 7, "method": "tools/call", "params": {"_meta": META, '
        '"name": "tool_calls", "arguments": @}}',
    ),
    (
        "tasks/update",
        '{"jsonrpc": "2.0", "id": 7, "method": "tasks/update", "params": {"_meta": META, '
        '"taskId": "TASK", "inputResponses": @}}',
    ),
    ("tasks/get", '{"jsonrpc": "2.0", "id": 7, "method": "tasks/get", "params": {"_meta": @, "taskId": "TASK"}}'),
    (
        None,
        '{"jsonrpc": "2.0", "id": 7, "method": "tools/call", "params": {"name": "tool_calls", "task": @, '
        '"arguments": @}}',
    ),
    (None, '{"jsonrpc": "2.0", "id": 7, "method": "tasks/list", "params": {"cursor": @}}'),
    (None, '{"jsonrpc": "2.0", "id": 7, "method": "tasks/cancel", "params": @}'),
    (None, '{"jsonrpc": "2.0", "id": @, "method": "tasks/get", "params": {"taskId": "TASK"}}'),
    (None, "@"),
]


def fill(template: str, body: tuple[str, str | bytes]) -> bytes:
    kind, value = body
    if kind == "raw":
        return value  # type: ignore[return-value]
    return template.replace("@", value).encode()  # type: ignore[arg-type]


def assert_answered(response: Any, before: tuple[int, ...], *, rpc: bool = False) -> None:
    """No 5xx; a refusal in the edge's error shape that wrote nothing."""
    assert response.status_code < 500, (response.status_code, response.content[:300])
    if response.status_code < 400 and not (rpc and b'"error"' in response.content):
        return
    body = response.json()
    if rpc:
        assert body["jsonrpc"] == "2.0" and body["id"] in (7, None) and body["error"]["message"], body
    else:
        assert body["error"]["code"] and body["error"]["message"], body
    assert written() == before, response.content[:300]


@PROPERTIES
@given(edge=st.sampled_from(["create", "steering", "inputs", "cancel"]), body=BODIES, which=st.integers(0, 4))
def test_rest_bodies(alice, task, edge, body, which):  # noqa: F811 (task: the fixture imported above)
    templates = rest_templates(str(task.id))[edge]
    path, template = templates[which % len(templates)]
    before = written()
    response = client().post(
        path, data=fill(template, body), content_type="application/json", HTTP_AUTHORIZATION=f"Bearer {alice.token}"
    )
    assert_answered(response, before)


@PROPERTIES
@given(wire=st.sampled_from(["2026-07-28", "2025-11-25"]), body=BODIES, which=st.integers(0, len(MCP_TEMPLATES) - 1))
def test_mcp_bodies(alice, task, wire, body, which):  # noqa: F811 (task: the fixture imported above)
    method, template = MCP_TEMPLATES[which]
    template = template.replace("META", json.dumps(META)).replace("TASK", str(task.id))
    headers = {"HTTP_ACCEPT": "application/json, text/event-stream", "HTTP_AUTHORIZATION": f"Bearer {alice.token}"}
    if wire == "2026-07-28":
        headers.update(
            HTTP_MCP_PROTOCOL_VERSION="2026-07-28",
            HTTP_MCP_METHOD=method or "tasks/get",
            HTTP_MCP_NAME="tool_calls" if method == "tools/call" else str(task.id),
        )
    before = written()
    response = client().post("/mcp", data=fill(template, body), content_type="application/json", **headers)
    assert_answered(response, before, rpc=True)


def query_and_header_requests(alice: Any, task: Any) -> dict[str, Callable[[str], Any]]:  # noqa: F811 (task: the fixture imported above)
    token = {"HTTP_AUTHORIZATION": f"Bearer {alice.token}"}
    events = f"/runtime/tasks/{task.id}/events"

    def q(text: str) -> str:  # as a browser would send it: UTF-8, percent-encoded (a surrogate as its bytes)
        return quote(text.encode("utf-8", "surrogatepass"), safe="")

    def cursor(text: str) -> str:
        return q(base64.b64encode(text.encode("utf-8", "surrogatepass")).decode())

    def dashboard(path: str) -> Any:
        browser = client()
        browser.force_login(alice.user)
        return browser.get(path)

    create = '{"agent": "noop", "input": {"steps": 3}}'
    return {
        "?status=": lambda s: client().get(f"/runtime/tasks?status={q(s)}", **token),
        "?limit=": lambda s: client().get(f"/runtime/tasks?limit={q(s)}", **token),
        "?cursor=": lambda s: client().get(f"/runtime/tasks?cursor={q(s)}", **token),
        "?cursor= (base64)": lambda s: client().get(f"/runtime/tasks?cursor={cursor(s)}", **token),
        "any query parameter": lambda s: client().get(f"/runtime/tasks?{q(s)}={q(s)}", **token),
        "dashboard ?status=": lambda s: dashboard(f"/dashboard/tasks.json?status={q(s)}"),
        "Last-Event-ID": lambda s: client().get(events, HTTP_LAST_EVENT_ID=s, **token),
        "?lastEventId=": lambda s: client().get(f"{events}?lastEventId={q(s)}", **token),
        "Idempotency-Key": lambda s: client().post(
            "/runtime/tasks", data=create, content_type="application/json", HTTP_IDEMPOTENCY_KEY=s, **token
        ),
        "Authorization": lambda s: client().get("/runtime/tasks", HTTP_AUTHORIZATION=f"Bearer rt_{s}_secret"),
        "input key in the path": lambda s: client().post(
            f"/runtime/tasks/{task.id}/inputs/{q(s) or 'k'}",
            data='{"answer": 1}',
            content_type="application/json",
            **token,
        ),
        "legacy tasks/list cursor": lambda s: client().post(
            "/mcp",
            data=json.dumps(
                {
                    "jsonrpc": "2.0",
                    "id": 7,
                    "method": "tasks/list",
                    "params": {"cursor": base64.urlsafe_b64encode(s.encode("utf-8", "surrogatepass")).decode()},
                }
            ),
            content_type="application/json",
            **token,
        ),
    }


STRING_EDGES = [
    "?status=",
    "?limit=",
    "?cursor=",
    "?cursor= (base64)",
    "any query parameter",
    "dashboard ?status=",
    "Last-Event-ID",
    "?lastEventId=",
    "Idempotency-Key",
    "Authorization",
    "input key in the path",
    "legacy tasks/list cursor",
]


@PROPERTIES
@given(edge=st.sampled_from(STRING_EDGES), text=STRINGS)
def test_query_strings_and_headers(alice, task, edge, text):  # noqa: F811 (task: the fixture imported above)
    before = written()
    response = query_and_header_requests(alice, task)[edge](text)
    assert_answered(response, before, rpc=edge.startswith("legacy"))
