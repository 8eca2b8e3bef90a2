"""Hostile bytes at the wire, against a real uvicorn process over raw sockets (a client
library would frame them for us): request bodies sent chunked, without a Content-Length.
HTTP/1.1 allows it and uvicorn accepts it; the runtime must neither ignore such a body nor
read one of any size (issue 12, hostile input)."""

from __future__ import annotations

import json
import socket

import pytest
from django.db import connection

from conftest import Processes, free_port
from tasks_app.access import console
from tasks_app.actions import do_create_task
from tasks_app.models import Task

pytestmark = pytest.mark.django_db(transaction=True)


def chunked(port: int, path: str, body: bytes, token: str, chunk: int = 65536) -> tuple[int, bytes]:
    """POST `body` with Transfer-Encoding: chunked; (status, response body). The server may
    answer and close before it has read everything: that is the answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.sendall(
            f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
            f"Authorization: Bearer {token}\r\nContent-Type: application/json\r\n"
            "Accept: application/json, text/event-stream\r\n"
            "Transfer-Encoding: chunked\r\n\r\n".encode()
        )
        try:
            for start in range(0, len(body), chunk):
                part = body[start : start + chunk]
                sock.sendall(b"%x\r\n%s\r\n" % (len(part), part))
            sock.sendall(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass
        answer = b""
        while data := sock.recv(65536):
            answer += data
    head, _, payload = answer.partition(b"\r\n\r\n")
    if b"transfer-encoding: chunked" in head.lower():
        payload = b"".join(payload.split(b"\r\n")[1::2])
    return int(head.split(b" ")[1]), payload


def sessions() -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()")
        return cursor.fetchone()[0]


def test_a_chunked_body_is_read_and_bounded_on_every_edge(processes: Processes, alice):
    port = free_port()
    processes.web(port)
    # Read: a chunked create is the same create (it used to be read as an empty body: a 400
    # saying `agent` is missing, for a body that has it).
    status, body = chunked(
        port, "/runtime/tasks", json.dumps({"agent": "noop", "input": {"steps": 1}}).encode(), alice.token, chunk=7
    )
    assert status == 201, body
    assert Task.objects.count() == 1
    status, body = chunked(port, "/mcp", b'{"jsonrpc": "2.0", "id": 3, "method": "tools/list"}', alice.token)
    assert status == 200 and json.loads(body)["id"] == 3, body
    # Bounded: several MB without a Content-Length are refused like those with one (they used
    # to be read whole, spooled to disk, and parsed).
    huge = b'{"agent": "noop", "input": {"steps": 1}, "goal": "' + b"a" * 5_000_000 + b'"}'
    for path in ("/runtime/tasks", "/mcp"):
        status, body = chunked(port, path, huge, alice.token)
        assert status == 413, (path, status, body[:300])
        assert json.loads(body)["error"]["code"] == "body_too_large", body[:300]
    assert Task.objects.count() == 1
    # And healthy: a normal answer right after, no connections left behind.
    before = sessions()
    status, body = chunked(port, "/runtime/tasks", b'{"agent": "noop", "input": {"steps": 1}}', alice.token)
    assert status == 201, body
    assert sessions() <= before + 1


def exchange(port: int, head: bytes, body: bytes = b"", timeout: float = 30) -> tuple[int, bytes]:
    """Send a request's head (and body) as given; (status, response body). None of the body
    need follow the head: a server that waits for it runs into the timeout."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(head + b"\r\n\r\n" + body)
        answer = b""
        while data := sock.recv(65536):
            answer += data
    head_out, _, payload = answer.partition(b"\r\n\r\n")
    if b"transfer-encoding: chunked" in head_out.lower():
        payload = b"".join(payload.split(b"\r\n")[1::2])
    return int(head_out.split(b" ")[1]), payload


def test_a_request_django_cannot_build_or_a_body_declared_too_large_is_a_clear_4xx(processes: Processes, alice):
    port = free_port()
    processes.web(port)
    start = f"Host: 127.0.0.1\r\nConnection: close\r\nAuthorization: Bearer {alice.token}\r\n".encode()
    create = b'{"agent": "noop", "input": {"steps": 1}}'
    for path in (b"/runtime/tasks", b"/mcp", b"/healthz"):
        # A Content-Type past Django's parameter-length limit: ASGIRequest raised BadRequest
        # in its constructor, out of the handler, and uvicorn answered 500 in plain text.
        head = b"POST %s HTTP/1.1\r\n%sContent-Type: application/json; x=%s\r\nContent-Length: %d" % (
            path,
            start,
            b"a" * 20_000,
            len(create),
        )
        status, body = exchange(port, head, create)
        assert status == 400, (path, status, body[:300])
        assert json.loads(body)["error"]["message"], body
        # A body announced larger than the limit is refused before it is read: it used to be
        # read whole (spooled to disk), here never sent, so the server waited for it.
        head = b"POST %s HTTP/1.1\r\n%sContent-Type: application/json\r\nContent-Length: 1000000000" % (path, start)
        status, body = exchange(port, head, timeout=20)
        assert status == 413, (path, status, body[:300])
        assert json.loads(body)["error"]["code"] == "body_too_large", body
    assert Task.objects.count() == 0
    status, body = exchange(
        port,
        b"POST /runtime/tasks HTTP/1.1\r\n%sContent-Type: application/json\r\nContent-Length: %d"
        % (start, len(create)),
        create,
    )
    assert status == 201, body


def test_a_single_value_header_sent_twice_is_a_400_naming_it(processes: Processes, alice):
    """Django joins a header sent twice with a comma: two Authorization headers read as one
    malformed key (a 401 blaming the key), two Idempotency-Keys as one key "a,b" that breaks
    its pattern, two Content-Types as "application/json,application/json" (a 415). Each is two
    requests' worth of intent in one; a 400 says which header, on every edge."""
    port = free_port()
    processes.web(port)
    task, _ = do_create_task(console(alice.tenant, f"user:{alice.user.pk}"), agent="noop", input={"steps": 1})
    auth = f"Authorization: Bearer {alice.token}".encode()
    create = b'{"agent": "noop", "input": {"steps": 1}}'
    post = b"POST /runtime/tasks HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\nContent-Length: %d\r\n" % len(
        create
    )
    rpc = b'{"jsonrpc": "2.0", "id": 3, "method": "tools/list"}'
    cases = {
        "Authorization": (
            b"GET /runtime/tasks/%s HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n%s\r\n%s"
            % (str(task.id).encode(), auth, auth),
            b"",
        ),
        "Content-Type": (post + auth + b"\r\nContent-Type: application/json\r\nContent-Type: application/json", create),
        "Idempotency-Key": (
            post + auth + b"\r\nContent-Type: application/json\r\nIdempotency-Key: a\r\nIdempotency-Key: b",
            create,
        ),
        "Mcp-Session-Id": (
            b"POST /mcp HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\nContent-Length: %d\r\n%s\r\n"
            b"Content-Type: application/json\r\nAccept: application/json, text/event-stream\r\n"
            b"Mcp-Session-Id: a\r\nMcp-Session-Id: b" % (len(rpc), auth),
            rpc,
        ),
    }
    before = Task.objects.count()
    for name, (head, body) in cases.items():
        status, answer = exchange(port, head, body)
        assert status == 400, (name, status, answer[:300])
        error = json.loads(answer)["error"]
        assert error["fields"] == {f"headers.{name}": "given 2 times; send it once"}, (name, error)
    # uvicorn (h11) refuses two Hosts and two Content-Lengths that differ itself, before the
    # application sees them (and takes two equal Content-Lengths as one: RFC 9110 §8.6 lets it).
    head = post + auth + b"\r\nContent-Type: application/json\r\nContent-Length: 3"
    assert exchange(port, head, create)[0] == 400
    assert exchange(port, b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nHost: 127.0.0.1\r\nConnection: close")[0] == 400
    assert Task.objects.count() == before
    status, answer = exchange(port, post + auth + b"\r\nContent-Type: application/json\r\nIdempotency-Key: a", create)
    assert status == 201, answer


def test_a_content_length_sent_twice_that_reaches_the_application_is_a_400_naming_it(alice):
    """A server that hands both on (the ASGI scope is a list of headers) gets the same 400."""
    import asyncio

    from asgiref.testing import ApplicationCommunicator

    from runtime_site.handlers import ByViewKind

    create = b'{"agent": "noop", "input": {"steps": 1}}'
    length = str(len(create)).encode()
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/runtime/tasks",
        "raw_path": b"/runtime/tasks",
        "root_path": "",
        "query_string": b"",
        "headers": [
            (b"host", b"testserver"),
            (b"authorization", f"Bearer {alice.token}".encode()),
            (b"content-type", b"application/json"),
            (b"content-length", length),
            (b"content-length", length),
        ],
        "server": ("testserver", 80),
        "client": ("127.0.0.1", 1234),
    }

    async def post() -> tuple[int, bytes]:
        communicator = ApplicationCommunicator(ByViewKind(), scope)
        await communicator.send_input({"type": "http.request", "body": create})
        start = await communicator.receive_output(10)
        body = (await communicator.receive_output(10))["body"]
        await communicator.wait(10)
        return start["status"], body

    status, body = asyncio.run(post())
    assert status == 400, body
    assert json.loads(body)["error"]["fields"] == {"headers.Content-Length": "given 2 times; send it once"}
    assert Task.objects.count() == 0
