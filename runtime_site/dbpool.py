"""The web process's connection pool (psycopg_pool, through Django) across database restarts.

Two psycopg_pool defaults turn a restart into minutes of 500s: a connection is handed out
without a look (dead ones fail the request that gets them), and a failed reconnection is
retried with a doubling pause for five minutes (a database back after a minute waits for
the pool's next try, a minute later). settings.py passes check_connection and a short
reconnect_timeout; runtime_site.errors answers what still fails meanwhile with a 503.
"""

from __future__ import annotations

import select
from typing import Any

from psycopg_pool import ConnectionPool


def check_connection(conn: Any) -> None:
    """psycopg_pool's check before handing a connection out, and on failure a drain: a
    connection the server ended is rarely alone (a restart or pg_terminate_backend ends
    them all), and the pool would otherwise try each dead one in turn, pausing longer
    (1 s, 2 s, 4 s ...) before each. Drained, the client waits for a fresh connection.

    The check's round trip is paid only when the socket has something to read: an idle
    connection hears from the server only when it is ended (the FATAL message, then the
    close, or the close alone from a killed server's kernel). A silent socket needs no
    query, which was one round trip in four of a snapshot read."""
    if not conn.closed and not readable(conn):
        return
    try:
        ConnectionPool.check_connection(conn)
    except Exception:
        from django.db import connections

        # connections[] is typed as the base wrapper; PostgreSQL's has the pool.
        connections["default"].pool.drain()  # type: ignore[attr-defined]
        raise


def readable(conn: Any) -> bool:
    """The socket of a psycopg connection has something to read (or is gone)."""
    poller = select.poll()  # not select.select: a web process holding streams has fds above its limit (1024)
    try:
        poller.register(conn.fileno(), select.POLLIN)
        return bool(poller.poll(0))
    except (OSError, ValueError):  # no socket any more
        return True
