"""An independent HTTP receiver that counts side effects (not our tables): a stand-in for a
remote API that honours Idempotency-Key and can be asked about a key.

    python tests/sink.py --port 8123 [--fail-first N] [--delay-ms MS]

POST /effects           records the call; the same key again gets the first answer (idempotent);
                        with --delay-ms, a slow remote: it answers that much later
POST /effects?hang=S    records the call, then holds the answer S seconds while watching the
                        connection: a caller that drops it is counted (a remote whose call was cut)
POST /effects?status=N  records the call, then answers with status N (with hang=S: after S seconds)
GET  /effects/<key>     200 with the effect, 404 if it never happened (a reconcile endpoint)
GET  /stats             {"posts": total POSTs, "perKey": {key: POSTs with that key}, "effects": n,
                         "traceparents": {key: the traceparent header of its last POST},
                         "hanging": answers held now, "dropped": held answers whose caller hung up}
"""

from __future__ import annotations

import argparse
import json
import select
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

lock = threading.Lock()
posts: dict[str, int] = {}
effects: dict[str, dict] = {}
traceparents: dict[str, str] = {}
state = {"total": 0, "fail_first": 0, "delay_ms": 0, "hanging": 0, "dropped": 0}


class Handler(BaseHTTPRequestHandler):
    def _send(self, status: int, body: object) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self) -> None:
        key = self.headers.get("Idempotency-Key", "")
        payload = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"null")
        time.sleep(state["delay_ms"] / 1000)
        with lock:
            state["total"] += 1
            posts[key] = posts.get(key, 0) + 1
            if self.headers.get("traceparent"):
                traceparents[key] = self.headers["traceparent"]
            if state["total"] <= state["fail_first"]:
                return self._send(503, {"error": "try again"})
            if key in effects:
                return self._send(200, effects[key])
            effects[key] = {"key": key, "payload": payload, "n": len(effects) + 1}
            answer = effects[key]
        query = parse_qs(urlsplit(self.path).query)
        hang = float(query.get("hang", ["0"])[0])
        if hang and self._caller_hung_up_within(hang):
            return None
        if "status" in query:  # a remote that refuses the call (after holding it)
            return self._send(int(query["status"][0]), {"error": "refused"})
        return self._send(201, answer)

    def _caller_hung_up_within(self, seconds: float) -> bool:
        """Hold the answer, watching the socket: readable with nothing to read is the caller gone."""
        with lock:
            state["hanging"] += 1
        try:
            until = time.monotonic() + seconds
            while time.monotonic() < until:
                if select.select([self.connection], [], [], 0.05)[0] and not self.connection.recv(1, socket.MSG_PEEK):
                    with lock:
                        state["dropped"] += 1
                    return True
            return False
        finally:
            with lock:
                state["hanging"] -= 1

    def do_GET(self) -> None:
        with lock:
            if self.path == "/stats":
                return self._send(
                    200,
                    {
                        "posts": state["total"],
                        "perKey": posts,
                        "effects": len(effects),
                        "traceparents": traceparents,
                        "hanging": state["hanging"],
                        "dropped": state["dropped"],
                    },
                )
            key = self.path.removeprefix("/effects/")
            if key in effects:
                return self._send(200, effects[key])
            return self._send(404, {"error": "no such effect"})

    def log_message(self, *args: object) -> None:
        pass


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--fail-first", type=int, default=0)
    parser.add_argument("--delay-ms", type=int, default=0)
    options = parser.parse_args()
    state["fail_first"], state["delay_ms"] = options.fail_first, options.delay_ms
    ThreadingHTTPServer(("127.0.0.1", options.port), Handler).serve_forever()
