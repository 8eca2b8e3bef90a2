"""The web process's ASGI handler (runtime_site/handlers.py): a sync request crosses from the
event loop to a thread once for its whole middleware chain and view, not once per middleware."""

from __future__ import annotations

from typing import Any

import pytest
from asgiref.sync import SyncToAsync
from asgiref.testing import ApplicationCommunicator

from runtime_site.handlers import ByViewKind


def scope(path: str) -> dict[str, Any]:
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "GET",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [],
        "server": ("testserver", 80),
        "client": ("127.0.0.1", 1234),
    }


async def get(app: Any, path: str) -> int:
    communicator = ApplicationCommunicator(app, scope(path))
    await communicator.send_input({"type": "http.request", "body": b""})
    start = await communicator.receive_output(10)
    await communicator.receive_output(10)
    await communicator.wait(10)
    return start["status"]


@pytest.mark.asyncio
async def test_a_sync_request_hops_to_a_thread_for_its_chain_once(monkeypatch):
    """Django's ASGIHandler hopped fifteen times for /healthz (every MiddlewareMixin's
    process_request and process_response, and the view): each hop a wake-up through the
    event loop and a wait for the GIL, 4 ms for a view that does nothing."""
    hops: list[str] = []
    original = SyncToAsync.__call__

    async def counted(self: SyncToAsync, *args: Any, **kwargs: Any) -> Any:
        hops.append(getattr(self.func, "__qualname__", repr(self.func)))
        return await original(self, *args, **kwargs)

    app = ByViewKind()
    monkeypatch.setattr(SyncToAsync, "__call__", counted)
    assert await get(app, "/healthz") == 200
    # request_started's receivers, the chain with the view, the response's close (request_finished)
    assert len(hops) <= 3, hops


def test_async_views_keep_the_event_loop():
    """/mcp is an async view (long waits on the loop, no thread each): it stays with Django's
    async handler; a sync view and an unknown path go to the one-hop chain."""
    from runtime_site.handlers import _async_view

    assert _async_view(scope("/mcp"))
    assert not _async_view(scope("/healthz"))
    assert not _async_view(scope("/runtime/tasks"))
    assert not _async_view(scope("/no/such/page"))
