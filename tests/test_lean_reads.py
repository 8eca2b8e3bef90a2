"""The lean path (runtime_site/lean.py) through the web process's ASGI handler, in process:
the snapshot, the event stream's start and the probes are answered on the event loop, with
no thread hop, and every answer is the full path's own, byte for byte (headers included);
whatever the lean path does not answer itself, the full path does."""

from __future__ import annotations

import asyncio
import re
import uuid
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any

import pytest
from asgiref.sync import SyncToAsync
from asgiref.testing import ApplicationCommunicator
from django.db import connection, transaction
from django.utils import timezone

from conftest import Persona, make_persona
from runtime_site import dbpool, lean, ratelimit
from runtime_site.handlers import ByViewKind
from tasks_app import engine, events
from tasks_app.auth import issue_api_key, revoke_api_key
from tasks_app.models import ApiKey, Task
from tasks_app.selectors import SNAPSHOT_FIELDS, task_snapshot, with_snapshot
from tasks_app.streams.hub import loop_hub
from tasks_app.streams.publish import channel_for
from tasks_app.tests.test_engine import new_task

# The lean reads use connections of their own, which see only committed rows.
pytestmark = pytest.mark.django_db(transaction=True)

Answer = tuple[int, list[tuple[bytes, bytes]], bytes]


@pytest.fixture(autouse=True)
def web_process_settings(settings: Any) -> None:
    settings.RUNTIME_DB_ASYNC_POOL = True  # as runtime_site/asgi.py sets it for the web process
    ratelimit._skip_until = 0.0


def scope(path: str, headers: dict[str, str]) -> dict[str, Any]:
    """The query string one byte a character (latin-1), so a test can send bytes that are not UTF-8."""
    path, _, query = path.partition("?")
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "GET",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": query.encode("latin-1"),
        "headers": [(b"host", b"testserver")] + [(k.lower().encode(), v.encode()) for k, v in headers.items()],
        "server": ("testserver", 80),
        "client": ("127.0.0.1", 1234),
    }


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def get(app: Any, path: str, headers: dict[str, str]) -> Answer:
    communicator = ApplicationCommunicator(app, scope(path, headers))
    await communicator.send_input({"type": "http.request", "body": b""})
    start = await communicator.receive_output(10)
    body = b""
    while True:
        message = await communicator.receive_output(10)
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    await communicator.wait(10)
    return start["status"], start["headers"], body


class Hops:
    """Thread hops (sync_to_async calls) made while it counts: none means the lean path answered."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        original = SyncToAsync.__call__

        async def counted(this: SyncToAsync, *args: Any, **kwargs: Any) -> Any:
            self.count += 1
            return await original(this, *args, **kwargs)

        monkeypatch.setattr(SyncToAsync, "__call__", counted)


def run(scenario: Callable[[], Awaitable[Any]]) -> Any:
    async def main() -> Any:
        try:
            return await scenario()
        finally:
            await dbpool.close_async_pool()

    return asyncio.run(main())


def lean_and_full(path: str, headers: dict[str, str], hops: Hops) -> tuple[Answer, int, Answer]:
    """The answer with the lean path on (and its thread hops), then with it off."""
    app = ByViewKind()

    async def scenario() -> tuple[Answer, int, Answer]:
        hops.count = 0
        answer = await get(app, path, headers)
        made = hops.count
        app.lean_path.enabled = False
        return answer, made, await get(app, path, headers)

    return run(scenario)


def waiting_for_input(persona: Persona) -> Task:
    task = new_task(persona, steps=3)
    Task.objects.filter(id=task.id).update(input={"steps": 3, "askAt": 1})
    engine.run_slice(task.id, worker_id="w1")
    return Task.objects.get(id=task.id)


def finished(persona: Persona) -> Task:
    task = new_task(persona, steps=3)
    while engine.run_slice(task.id, worker_id="w1") is engine.SliceOutcome.CONTINUE:
        pass
    return Task.objects.get(id=task.id)


def failed_with_text(persona: Persona) -> Task:
    task = new_task(persona, steps=3, goal="résumé \u2028 ✓")
    Task.objects.filter(id=task.id).update(status="failed", error={"code": "boom", "message": "ü \u2029 \x7f"})
    return task


@pytest.mark.parametrize("make", [new_task, waiting_for_input, finished, failed_with_text])
def test_a_snapshot_is_read_on_the_event_loop_and_reads_as_the_full_path(alice, monkeypatch, make):
    task = make(alice)
    hops = Hops(monkeypatch)
    answer, made, full = lean_and_full(f"/runtime/tasks/{task.id}", bearer(alice.token), hops)
    assert answer[0] == 200 and made == 0, (answer, made)
    assert answer == full


def test_the_snapshot_carries_the_last_checkpoint_and_the_open_questions(alice, monkeypatch):
    import json

    asking, done = waiting_for_input(alice), finished(alice)
    hops = Hops(monkeypatch)
    (_, _, first), _, _ = lean_and_full(f"/runtime/tasks/{asking.id}", bearer(alice.token), hops)
    (_, _, second), _, _ = lean_and_full(f"/runtime/tasks/{done.id}", bearer(alice.token), hops)
    assert json.loads(first)["inputRequests"] and json.loads(second)["lastCheckpoint"] is not None


def everything_else(alice: Persona, mallory: Persona) -> dict[str, tuple[str, dict[str, str]]]:
    task = new_task(alice)
    url = f"/runtime/tasks/{task.id}"
    _, narrow = issue_api_key(alice.tenant, alice.user, role="operator", name="operate-only", scopes=["operate"])
    _, revoked = issue_api_key(alice.tenant, alice.user, role="operator", name="revoked")
    revoke_api_key(ApiKey.objects.get(name="revoked"))
    _, expired = issue_api_key(alice.tenant, alice.user, role="operator", name="old", expires_at=timezone.now())
    gone = make_persona("acme", "gone", "viewer")
    gone.user.is_active = False
    gone.user.save(update_fields=["is_active"])
    prefix = alice.token.rsplit("_", 1)[0]
    return {
        "no credentials": (url, {}),
        "not a key": (url, bearer("rt_nothex_" + "x" * 40)),
        "a wrong secret": (url, bearer(f"{prefix}_{'y' * 43}")),
        "a revoked key": (url, bearer(revoked)),
        "an expired key": (url, bearer(expired)),
        "a deactivated user": (url, bearer(gone.token)),
        "a key without the read scope": (url, bearer(narrow)),
        "another tenant's task": (url, bearer(mallory.token)),
        "no such task": ("/runtime/tasks/7d4b0f64-9d55-4a43-9a5c-1f0e5d7c1b2a", bearer(alice.token)),
        "not an id": ("/runtime/tasks/not-an-id", bearer(alice.token)),
        "a NUL in a header": (url, {**bearer(alice.token), "X-Note": "a\x00b"}),
        "a JWT": (url, bearer("eyJhbGciOiJIUzI1NiJ9.e30.sig")),
        # What the full path refuses before any view: the lean path raised out of the handler (a 500)
        # or answered the snapshot as if the request had been well formed.
        "a Content-Type past Django's limit": (
            url,
            {**bearer(alice.token), "Content-Type": "text/plain; x=" + "a" * 20_000},
        ),
        "a query string that is not UTF-8": (f"{url}?a=\xff\xfe", bearer(alice.token)),
        "bad percent-encoding": (f"{url}?a=%zz", bearer(alice.token)),
        "percent-encoding that is not UTF-8": (f"{url}?a=%ff", bearer(alice.token)),
        # What DRF's content negotiation refuses: a ?format= no renderer has, an Accept none satisfies.
        "?format=xml": (f"{url}?format=xml", bearer(alice.token)),
        "?format=api": (f"{url}?format=api", bearer(alice.token)),
        "Accept: text/html": (url, {**bearer(alice.token), "Accept": "text/html"}),
        "Accept: application/xml": (url, {**bearer(alice.token), "Accept": "application/xml"}),
    }


def test_every_other_answer_is_the_full_paths(alice, mallory, monkeypatch):
    cases = everything_else(alice, mallory)
    hops = Hops(monkeypatch)
    for name, (path, headers) in cases.items():
        answer, made, full = lean_and_full(path, headers, hops)
        assert answer[0] in (400, 401, 403, 404, 406), (name, answer)
        assert made > 0, f"{name}: answered on the lean path"
        assert answer == full, name


@pytest.mark.parametrize(
    ("query", "accept"),
    [
        ("?format=json", None),
        ("", "application/json; indent=2"),
        ("", "*/*"),
        ("", "text/html, application/json;q=0.1"),
        ("", "application/*"),
    ],
)
def test_content_negotiation_on_the_event_loop_answers_as_the_full_path(alice, monkeypatch, query, accept):
    """An Accept or ?format= the JSON renderer satisfies: the lean path answers it, exactly as
    DRF renders it for that request (indent=2 is indented)."""
    task = new_task(alice)
    headers = {**bearer(alice.token), **({"Accept": accept} if accept else {})}
    answer, made, full = lean_and_full(f"/runtime/tasks/{task.id}{query}", headers, Hops(monkeypatch))
    assert (answer[0], made) == (200, 0), (answer, made)
    assert answer == full


def test_a_throttled_snapshot_is_counted_once_and_refused_as_the_full_path_refuses_it(alice, settings, monkeypatch):
    settings.RUNTIME = {**settings.RUNTIME, "limits": {**settings.RUNTIME["limits"], "window_seconds": 10**9}}
    settings.RUNTIME["limits"].update({"rest_per_key": 2, "rest_per_tenant": 0})
    task = new_task(alice)
    app, hops = ByViewKind(), Hops(monkeypatch)
    url = f"/runtime/tasks/{task.id}"

    async def scenario() -> list[tuple[Answer, int]]:
        answers = []
        for lean_on in (True, True, True, False):
            app.lean_path.enabled = lean_on
            hops.count = 0
            answers.append((await get(app, url, bearer(alice.token)), hops.count))
        return answers

    (ok, ok_hops), (again, _), (refused, refused_hops), (full, _) = run(scenario)
    assert (ok[0], again[0], ok_hops) == (200, 200, 0)  # the first two, each counted once
    assert (refused[0], refused_hops) == (429, 0)
    # Retry-After and the message's "in N seconds" count down to the window's end: a second
    # may tick between the two answers (it did in CI), so they are compared without the number.
    retry = b"Retry-After"
    assert [h for h in refused[1] if h[0] != retry] == [h for h in full[1] if h[0] != retry]
    assert abs(int(dict(refused[1])[retry]) - int(dict(full[1])[retry])) <= 1 and int(dict(refused[1])[retry]) > 0
    countdown = re.compile(rb"in \d+ seconds")
    assert countdown.search(refused[2]) and countdown.sub(b"", refused[2]) == countdown.sub(b"", full[2])


def test_a_lean_read_notes_the_keys_use(alice):
    ApiKey.objects.filter(name="alice-key").update(last_used_at=timezone.now() - timedelta(hours=1))
    task = new_task(alice)

    async def scenario() -> Answer:
        return await get(ByViewKind(), f"/runtime/tasks/{task.id}", bearer(alice.token))

    assert run(scenario)[0] == 200
    assert timezone.now() - ApiKey.objects.get(name="alice-key").last_used_at < timedelta(minutes=1)


@pytest.mark.parametrize("path", ["/healthz", "/readyz"])
def test_probes_answer_on_the_event_loop(path, monkeypatch):
    hops = Hops(monkeypatch)
    answer, made, full = lean_and_full(path, {}, hops)
    assert (answer[0], made) == (200, 0)
    assert answer == full


def test_the_lean_path_runs_only_behind_middleware_it_was_checked_against(settings):
    assert lean.LeanPath().enabled  # every entry of settings.MIDDLEWARE is in LEAN_MIDDLEWARE
    settings.MIDDLEWARE = [*settings.MIDDLEWARE, "opentelemetry.instrumentation.django.middleware.Whatever"]
    assert not lean.LeanPath().enabled


def test_the_snapshot_fields_are_every_field_task_snapshot_reads(alice, django_assert_num_queries):
    task = waiting_for_input(alice)
    loaded = with_snapshot(Task.objects.only(*SNAPSHOT_FIELDS), prefetch_inputs=True).get(id=task.id)
    with django_assert_num_queries(0):  # a field it reads that the lean read leaves out would be a query
        snapshot = task_snapshot(loaded)
    assert snapshot == task_snapshot(Task.objects.get(id=task.id))


async def first_chunks(app: Any, path: str, headers: dict[str, str], n: int) -> tuple[Any, dict[str, Any], bytes]:
    communicator = ApplicationCommunicator(app, scope(path, headers))
    await communicator.send_input({"type": "http.request", "body": b""})
    start = await communicator.receive_output(10)
    body = b""
    for _ in range(n):
        body += (await communicator.receive_output(10))["body"]
    return communicator, start, body


def emit_log(task_id: Any) -> None:
    try:
        with transaction.atomic():
            events.emit(Task.objects.get(id=task_id), "log", {"line": "hello"})
    finally:
        connection.close()


def test_an_event_stream_opens_on_the_event_loop_as_the_full_path_opens_it_and_carries_events(alice, monkeypatch):
    task = new_task(alice)
    url = f"/runtime/tasks/{task.id}/events"
    app, hops = ByViewKind(), Hops(monkeypatch)

    async def scenario() -> tuple[Any, ...]:
        hub = loop_hub()
        hops.count = 0
        stream, start, opened = await first_chunks(app, url, bearer(alice.token), 2)
        made = hops.count
        app.lean_path.enabled = False
        full, full_start, full_opened = await first_chunks(app, url, bearer(alice.token), 2)
        await full.send_input({"type": "http.disconnect"})
        await full.wait(10)
        async with asyncio.timeout(10):
            while not hub.live:  # the process's subscription is up (a deadline, not a sleep)
                await asyncio.sleep(0.01)
        await asyncio.to_thread(emit_log, task.id)
        event = (await stream.receive_output(10))["body"]
        await stream.send_input({"type": "http.disconnect"})
        await stream.wait(10)
        return start, opened, made, event, hub.open_streams, full_start, full_opened

    start, opened, made, event, open_after, full_start, full_opened = run(scenario)
    assert (start["status"], made) == (200, 0)
    assert (start, opened) == (full_start, full_opened)  # status, headers, snapshot, stream-open
    seq = Task.objects.get(id=task.id).event_seq
    assert b"event: log\n" in event and f":{seq}\n".encode() in event
    assert open_after == 0  # the client went: its stream left the hub


def test_an_event_id_of_another_stream_or_beyond_the_last_event_is_the_full_paths_400(alice, monkeypatch):
    """A well-formed Last-Event-ID this task's stream never sent: the lean path leaves it to
    the full view, whose 400 names it (it used to open the stream as if it fitted)."""
    task = new_task(alice)
    own = channel_for(task.id)
    url = f"/runtime/tasks/{task.id}/events"
    hops = Hops(monkeypatch)
    for last_event_id in (f"{channel_for(uuid.uuid4())}:0", f"{own}:{task.event_seq + 1}"):
        answer, made, full = lean_and_full(url, {**bearer(alice.token), "Last-Event-ID": last_event_id}, hops)
        assert answer[0] == 400 and made > 0, (last_event_id, answer)
        assert answer == full and b"Last-Event-ID" in answer[2], answer
