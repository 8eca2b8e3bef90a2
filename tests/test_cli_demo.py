"""`bin/run demo` (rtcli.demo) tells the whole story on the embedded default: SQLite, the
filesystem broker, its own web, two workers and beat; no PostgreSQL or Redis involved."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT

pytestmark = pytest.mark.e2e  # its own processes: web, two workers and beat


def test_the_demo_runs_the_whole_story_on_the_embedded_default(tmp_path):
    data = tmp_path / "demo"
    demo = subprocess.Popen(
        [sys.executable, "-m", "rtcli.demo", "--data", str(data), "--count", "200", "--pacing", "150"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        out, err = demo.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        demo.terminate()  # SIGTERM: the demo stops its web, workers and beat before it exits
        out, err = demo.communicate(timeout=60)
        raise AssertionError("the demo did not finish in 300 s:\n" + out[-3000:] + err[-3000:]) from None
    assert demo.returncode == 0, out[-3000:] + err[-3000:]
    for chapter in (
        "1. Generate a corpus",
        "2. Start a document review",
        "3. Watch it live",
        "4. Pause it",
        "5. Resume it",
        "6. Kill the worker holding the task",
        "7. Approve the publish step",
        "8. completed",
    ):
        assert f"== {chapter}" in out, chapter
    assert "paused at a safe point" in out and "recovered, handed on to a surviving worker" in out
    assert "back to work on the surviving worker from checkpoint" in out
    assert (data / "runtime.sqlite3").exists()  # the embedded database, not the test's PostgreSQL
    # The dashboard it points people to is styled: its web process serves <data>/static (whitenoise).
    assert (data / "static" / "dashboard" / "dashboard.css").exists() and (data / "static" / "admin").is_dir()
    published = [line.split("on disk: ", 1)[1] for line in out.splitlines() if "on disk: " in line]
    assert len(published) == 2 and all(Path(p).read_text().startswith("#") for p in published)
    assert "recoveries: 1" in out
