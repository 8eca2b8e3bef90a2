"""The command-line client refuses what it cannot send with a message and exit code 2
(usage), never a traceback: JSON only Python reads (NaN, Infinity, 1e400), a lone
surrogate, and a server it cannot reach. Real `python -m rtcli` processes; nothing needs
to listen on the port (that is the unreachable case, and the others never send)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import ROOT, free_port


def rt(*argv: str) -> subprocess.CompletedProcess[str]:
    base = f"http://127.0.0.1:{free_port()}"
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
    ],
)
def test_what_the_cli_cannot_send_is_a_message_and_exit_code_2(argv, said):
    done = rt(*argv)
    assert (done.returncode, "Traceback" in done.stderr) == (2, False), done.stderr
    assert said in done.stderr, done.stderr
