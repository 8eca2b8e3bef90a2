"""A loopback TCP proxy that adds `Authorization: Bearer <key>` to each HTTP request.

The conformance suite cannot send credentials, and /mcp always requires them; rather than
weaken the server for the suite, the suite talks to this proxy. Host and Origin pass
through untouched (the DNS-rebinding checks depend on them). Each connection carries one
request (Connection: close), so every request gets the header.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading


class AuthProxy:
    def __init__(self, upstream_port: int, token: str) -> None:
        self.upstream_port, self.token = upstream_port, token
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def __enter__(self) -> AuthProxy:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the auth proxy did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        server = self._loop.run_until_complete(asyncio.start_server(self._handle, "localhost", 0))
        self.port = server.sockets[0].getsockname()[1]
        # "localhost" may bind ::1 and 127.0.0.1 on different ports; bind the rest to ours
        for host in ("127.0.0.1", "::1"):
            with contextlib.suppress(OSError):
                self._loop.run_until_complete(asyncio.start_server(self._handle, host, self.port))
        self._ready.set()
        self._loop.run_forever()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            writer.close()
            return
        lines = head[:-4].split(b"\r\n")
        kept = [lines[0]] + [
            line for line in lines[1:] if not line.lower().startswith((b"authorization:", b"connection:"))
        ]
        kept += [f"Authorization: Bearer {self.token}".encode(), b"Connection: close"]
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        except OSError:
            writer.close()
            return
        up_writer.write(b"\r\n".join(kept) + b"\r\n\r\n")

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while chunk := await src.read(65536):
                    dst.write(chunk)
                    await dst.drain()
            except (ConnectionError, asyncio.CancelledError):
                pass
            finally:
                with contextlib.suppress(Exception):
                    dst.close()

        upload = asyncio.ensure_future(pipe(reader, up_writer))
        await pipe(up_reader, writer)
        upload.cancel()
