"""The command-line client refuses what it cannot send with a message and exit code 2
(usage), never a traceback: JSON only Python reads (NaN, Infinity, 1e400), a lone
surrogate, an API key or URL no request can carry, a task id that is no path segment, and
a server it cannot reach. Real `python -m rtcli` processes; nothing needs to listen on the
port (that is the unreachable case, and the others never send). Answers it cannot use (a
proxy's page, a body of another shape, an error without the API's shape) come from a
plain HTTP server of the test's own: one line and exit code 2 as well."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from conftest import ROOT, free_port


def rt(*argv: str, base: str | None = None) -> subprocess.CompletedProcess[str]:
    base = base or f"http://127.0.0.1:{free_port()}"
    return subprocess.run(
        [sys.executable, "-m", "rtcli", "--url", base, "--api-key", "rt_x_y", *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["submit", "--input", '{"count": NaN}'], "--input is not JSON: NaN is not a JSON number"),
        (["submit", "--input", '{"count": -Infinity}'], "--input is not JSON: -Infinity is not a JSON number"),
        (["submit", "--input", '{"count": 1e400}'], "--input is not JSON: Out of range float"),
        (["submit", "--input", '{"goal": "\\ud800"}'], "--input has a lone surrogate ('\\ud800')"),
        (["steer", "some-task", "adjust_goal", "--constraints", '{"x": NaN}'], "--constraints is not JSON"),
        (["list"], "rt: cannot reach http://127.0.0.1:"),
        (["--api-key", "clé", "list"], "rt: the API key has characters no API key has"),
        (["--api-key", "a\nb", "list"], "rt: the API key has characters no API key has"),
        (["--url", "http://[::1", "list"], "rt: --url 'http://[::1' is not a URL"),
        (["show", ".."], "rt: task id '..' is not a valid task id"),
        (["watch", "a\nb"], "rt: task id 'a\\nb' is not a valid task id"),
        (["steer", "some-task", "set_priority", "--expected-version", "1"], "rt: set_priority needs --priority 0-9"),
    ],
)
def test_what_the_cli_cannot_send_is_a_message_and_exit_code_2(argv, said):
    done = rt(*argv)
    assert (done.returncode, "Traceback" in done.stderr) == (2, False), done.stderr
    assert said in done.stderr, done.stderr


class Answering(BaseHTTPRequestHandler):
    """Every request gets the server's one canned answer."""

    def answer(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        status, content_type, body = self.server.canned  # type: ignore[attr-defined]
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = answer  # noqa: N815 (http.server's hook names)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def answering() -> Iterator[ThreadingHTTPServer]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Answering)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    thread.join(timeout=10)
    server.server_close()


COMMANDS = [
    ["list"],
    ["show", "t"],
    ["submit"],
    ["steer", "t", "pause"],
    ["steer", "t", "pause", "--expected-version", "1"],
    ["approve", "t"],
    ["artifact", "t"],
    ["watch", "t"],
]


@pytest.mark.parametrize(
    "canned",
    [
        (200, "text/html", b"<html>a proxy's page</html>"),
        (200, "application/json", b"[1, 2]"),
        (200, "application/json", b"{}"),
        (200, "application/json", b'{"results": [{"x": 1}]}'),
        (200, "application/json", b'{"results": 5}'),
        (200, "application/json", b"\xff\xfe"),
        (500, "text/html", b"<html>oops</html>"),
        (400, "application/json", b'{"error": "bad"}'),
        (400, "application/json", b"[1]"),
        (409, "application/json", b'{"error": {"code": "version_conflict", "message": "stale"}}'),
    ],
    ids=lambda canned: f"{canned[0]}-{canned[2][:20]!r}",
)
def test_an_answer_the_cli_cannot_use_is_one_line_and_exit_code_2(answering, canned):
    answering.canned = canned  # type: ignore[attr-defined]
    base = f"http://127.0.0.1:{answering.server_address[1]}"
    for argv in COMMANDS:
        if argv[0] == "show" and canned[0] == 200 and canned[2].startswith(b"{"):
            continue  # show prints the object it got, whatever its fields
        done = rt(*argv, base=base)
        assert "Traceback" not in done.stderr, (argv, done.stderr)
        # a 409 version_conflict is the documented 3, even without the snapshot it usually carries
        assert done.returncode == (3 if canned[0] == 409 else 2), (argv, done.returncode, done.stderr)
        assert done.stderr.startswith("rt: ") and done.stderr.count("\n") == 1, (argv, done.stderr)


def test_an_artifact_it_cannot_write_is_one_line_and_exit_code_2(answering, tmp_path):
    answering.canned = (200, "text/markdown", b"# report")  # type: ignore[attr-defined]
    base = f"http://127.0.0.1:{answering.server_address[1]}"
    done = rt("artifact", "t", "report.md", "-o", str(tmp_path / "missing" / "report.md"), base=base)
    assert (done.returncode, "Traceback" in done.stderr) == (2, False), done.stderr
    assert "rt: cannot write" in done.stderr and "No such file or directory" in done.stderr, done.stderr
