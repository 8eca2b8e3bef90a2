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
