"""The command-line client (rtcli, bin/rt) against a live uvicorn and a real worker:
submit, watch with progress to the result, steer (pause/resume, a stale version), approve."""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import pytest

from conftest import FAST_LEASES, ROOT, Processes, free_port, make_persona, wait_until
from runtime_site.blobstore import blob_store
from tasks_app.agents.document_review.corpus import generate_corpus
from tasks_app.models import Task

pytestmark = pytest.mark.django_db(transaction=True)

FAST = {**FAST_LEASES, "RUNTIME_SLICE_STEPS": "4"}


class Rt:
    def __init__(self, base: str, key: str) -> None:
        self.args = [sys.executable, "-m", "rtcli", "--url", base, "--api-key", key]

    def run(self, *argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*self.args, *argv], cwd=ROOT, capture_output=True, text=True, check=False, timeout=60)

    def start(self, *argv: str) -> tuple[subprocess.Popen[str], list[str]]:
        """Run in the background, collecting its output lines as they come."""
        proc = subprocess.Popen(
            [*self.args, *argv], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        lines: list[str] = []
        threading.Thread(target=lambda: [lines.append(line.rstrip("\n")) for line in proc.stdout], daemon=True).start()
        return proc, lines


def percents(lines: list[str]) -> list[int]:
    return [int(line.split("]")[1].split("%")[0]) for line in list(lines) if line.startswith("[")]


def test_watch_shows_progress_live_through_pause_and_approval_and_ends_with_the_result(alice, processes: Processes):
    approver_key = make_persona("acme", "april", "approver").token
    generate_corpus(blob_store(), "corpora/cli", 120, 3, "2026-11-01")
    port = free_port()
    processes.web(port)
    processes.worker(**FAST)
    processes.beat(**FAST)
    base = f"http://127.0.0.1:{port}"
    rt, approver = Rt(base, alice.token), Rt(base, approver_key)

    submitted = rt.run(
        "submit",
        "--input",
        json.dumps({"corpus": "corpora/cli", "batchSize": 8, "pacingMs": 300, "publish": True}),
        "--goal",
        "cli review",
    )
    assert submitted.returncode == 0, submitted.stderr
    task_id = submitted.stdout.strip()
    assert Task.objects.filter(id=task_id, agent="document_review").exists()
    assert task_id in rt.run("list").stdout

    watcher, lines = rt.start("watch", task_id)
    try:
        wait_until(lambda: any(p > 0 for p in percents(lines)), timeout=60, what="progress in watch's output")
        assert any("risk_classification" in line for line in lines)

        paused = rt.run("steer", task_id, "pause", "--reason", "coffee")
        assert paused.returncode == 0 and "pause accepted" in paused.stdout, paused.stderr
        wait_until(
            lambda: any("pause applied; task is paused" in line for line in lines),
            timeout=30,
            what="watch to show the pause",
        )
        # a decision made on an old version is refused, and says what the task is now
        stale = rt.run("steer", task_id, "set_priority", "--priority", "1", "--expected-version", "1")
        assert stale.returncode == 3 and "someone changed this task first" in stale.stderr
        assert "paused" in stale.stderr
        resumed = rt.run("steer", task_id, "resume")
        assert resumed.returncode == 0, resumed.stderr
        wait_until(
            lambda: any("waiting for input approve-" in line for line in lines),
            timeout=90,
            what="watch to show the approval request",
        )
        assert rt.run("approve", task_id).returncode == 2  # an operator may not approve (403)
        approved = approver.run("approve", task_id)
        assert approved.returncode == 0 and "approve sent" in approved.stdout, approved.stderr
        assert watcher.wait(timeout=90) == 0
    finally:
        if watcher.poll() is None:
            watcher.kill()
    output = "\n".join(lines)
    shown = percents(lines)
    assert shown == sorted(shown) and shown[-1] == 100, shown  # never backwards, ends full
    assert f"completed: task {task_id}" in output
    result = json.loads(output.split("\nresult: ", 1)[1].splitlines()[0])
    assert f"published: {result['published']['ref']}" in output
    assert result["documentsReviewed"] == 120 and result["published"]["ref"].endswith("report.md")
    assert Task.objects.get(id=task_id).status == "completed"


def test_the_cli_refuses_without_a_key_and_reports_http_errors(alice, processes: Processes):
    port = free_port()
    processes.web(port)
    rt = Rt(f"http://127.0.0.1:{port}", alice.token)
    no_key = subprocess.run(
        [sys.executable, "-m", "rtcli", "list"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
        env={"PATH": "/usr/bin:/bin"},
        timeout=30,
    )
    assert no_key.returncode == 2 and "API key" in no_key.stderr
    missing = rt.run("show", "00000000-0000-0000-0000-000000000000")
    assert missing.returncode == 2 and "404" in missing.stderr
    bad = rt.run("submit", "--input", json.dumps({"corpus": "/abs"}))
    assert bad.returncode == 2 and "422" in bad.stderr
