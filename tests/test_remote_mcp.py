"""The remote MCP tool (`mcp.call`) with real worker processes, against a small MCP server
built with the official SDK (tests/mcp_remote.py), which counts the calls it executes.
Effects are counted there, never in our own tables."""

from __future__ import annotations

import sys

import httpx
import pytest

from conftest import FAST_LEASES, ROOT, Processes, answers, free_port, settled, wait_until
from ledger_app.models import LedgerEntry
from tasks_app.access import console
from tasks_app.actions import do_create_task
from tasks_app.models import Task

pytestmark = pytest.mark.django_db(transaction=True)

FAST = {
    **FAST_LEASES,
    "RUNTIME_STALL_SECONDS": "2",
    "SECURITY_HTTP_ALLOWLIST": "127.0.0.1",
    "TOOLS_REMOTE_WAIT_SECONDS": "1",
    "TOOLS_REMOTE_POLL_SECONDS": "0.5",
}


class Remote:
    def __init__(self, processes: Processes, token: str | None = None) -> None:
        port = free_port()
        processes.start(
            "mcp-remote",
            [
                sys.executable,
                str(ROOT / "tests" / "mcp_remote.py"),
                "--port",
                str(port),
                *(["--token", token] if token else []),
            ],
        )
        self.url = f"http://127.0.0.1:{port}"
        self.mcp = f"{self.url}/mcp"
        wait_until(lambda: answers(f"{self.url}/stats"), timeout=20, what="the remote MCP server")

    def stats(self) -> dict:
        return httpx.get(f"{self.url}/stats", timeout=5).json()


def calls(alice, remote: Remote, *tool_calls: tuple[str, dict]) -> Task:
    payload = {
        "calls": [
            {"tool": "mcp.call", "args": {"server": remote.mcp, "tool": name, **args}} for name, args in tool_calls
        ]
    }
    return do_create_task(console(alice.tenant, "user:test"), agent="tool_calls", input=payload)[0]


def test_remote_tools_are_called_once_each_and_their_results_kept(alice, processes):
    remote = Remote(processes)
    processes.worker(**FAST)
    task = settled(
        calls(alice, remote, ("record", {"arguments": {"text": "a"}}), ("record", {"arguments": {"text": "b"}}))
    )
    assert task.status == "completed", task.error
    assert [r["structuredContent"]["result"] for r in task.result["results"]] == ["recorded a", "recorded b"]
    assert remote.stats()["effects"] == {"record": 2}
    assert set(LedgerEntry.objects.filter(task=task).values_list("status", flat=True)) == {"succeeded"}


def test_a_remote_task_is_polled_to_completion_across_a_worker_restart(alice, processes):
    remote = Remote(processes)
    worker = processes.worker(**FAST)
    processes.beat(**FAST)
    task = calls(alice, remote, ("long_job", {"arguments": {"seconds": 6, "label": "report"}}))
    entry = wait_until(
        lambda: LedgerEntry.objects.filter(task=task, status="pending").first(),
        timeout=30,
        what="the remote task id in the ledger",
    )
    assert entry.remote_ref and remote.stats()["tasks"] == 1
    wait_until(
        lambda: "remote task" in Task.objects.get(id=task.id).status_message,
        timeout=10,
        what="the wait to show in the status message",
    )
    processes.kill(worker)  # kill -9, while the remote task is still running
    assert remote.stats()["polls"].get(entry.remote_ref, 0) >= 1
    processes.worker(**FAST)
    task = settled(task)
    assert task.status == "completed", task.error
    assert task.result["results"][0]["structuredContent"] == {"label": "report"}
    stats = remote.stats()
    assert stats["effects"] == {"long_job": 1}  # called once: the restart polled, it did not call again
    assert stats["polls"][entry.remote_ref] >= 2
    entry.refresh_from_db()
    assert entry.status == "succeeded" and entry.attempts == 1


def test_a_crash_right_after_the_remote_took_the_task_still_polls_it(alice, processes, tmp_path):
    remote = Remote(processes)
    marker = tmp_path / "crashed"
    processes.worker(**FAST, RUNTIME_FAULT_INJECTION=f"ledger:after_remote_task:{marker}")
    processes.beat(**FAST)
    task = settled(calls(alice, remote, ("long_job", {"arguments": {"seconds": 1, "label": "x"}})))
    assert marker.exists(), "the fault was never injected"
    assert task.status == "completed", task.error
    assert task.recoveries >= 1 and remote.stats()["effects"] == {"long_job": 1}


def test_a_remote_call_interrupted_before_its_answer_was_kept_asks_a_person(alice, processes, tmp_path):
    remote = Remote(processes)
    marker = tmp_path / "crashed"
    processes.worker(**FAST, RUNTIME_FAULT_INJECTION=f"ledger:after_call:{marker}")
    processes.beat(**FAST)
    task = settled(calls(alice, remote, ("record", {"arguments": {"text": "once"}})))
    assert task.status == "input_required"
    entry = LedgerEntry.objects.get(task=task)
    assert entry.status == "unknown"
    assert remote.stats()["effects"] == {"record": 1}  # and it stays that way
    snapshot = alice.client().get(f"/runtime/tasks/{task.id}").json()
    [request] = snapshot["inputRequests"]
    assert request["key"] == f"confirm-{entry.key}"
    answer = alice.client().post(
        f"/runtime/tasks/{task.id}/steering",
        {
            "commandId": "confirm-1",
            "type": "provide_input",
            "payload": {"key": request["key"], "answer": "done"},
            "expectedVersion": snapshot["stateVersion"],
        },
        format="json",
    )
    assert answer.status_code == 202, answer.content
    task = settled(task)
    assert task.status == "completed"
    # The remote's answer is lost; the result says so instead of passing off a null for it.
    assert task.result == {"results": [{"reconciled": True, "answerLost": True}]}
    assert remote.stats()["effects"] == {"record": 1}


def test_a_remote_tool_timeout_is_retried_a_bounded_number_of_times_then_fails_diagnosably(alice, processes):
    remote = Remote(processes)
    processes.worker(**FAST)
    task = settled(calls(alice, remote, ("slow", {"arguments": {"seconds": 30}, "timeoutSeconds": 0.5})))
    assert task.status == "failed" and task.error["code"] == "tool_failed"
    assert "timed out" in task.error["message"] and "after 3 attempts" in task.error["message"]
    entry = LedgerEntry.objects.get(task=task)
    assert entry.status == "failed" and entry.attempts == 3 and len(entry.durations_ms) == 3
    assert entry.error["retryable"] is True
    assert remote.stats()["effects"].get("slow_started") == 3  # bounded: three attempts reached it


def test_an_unknown_remote_tool_fails_the_step_without_retrying(alice, processes):
    remote = Remote(processes)
    processes.worker(**FAST)
    task = settled(calls(alice, remote, ("no_such_tool", {"arguments": {}})))
    assert task.status == "failed" and "Unknown tool" in task.error["message"]
    assert LedgerEntry.objects.get(task=task).attempts == 1


def test_a_remote_that_needs_a_bearer_token_gets_it_from_the_worker_not_from_the_task(alice, processes):
    remote = Remote(processes, token="s3cret-remote-token")
    processes.worker(**FAST, RUNTIME_CREDENTIAL_REMOTE_A="s3cret-remote-token")
    task = settled(calls(alice, remote, ("record", {"arguments": {"text": "a"}, "credential": "remote_a"})))
    assert task.status == "completed", task.error
    refused = settled(calls(alice, remote, ("record", {"arguments": {"text": "b"}, "credential": "missing"})))
    assert refused.status == "failed" and "RUNTIME_CREDENTIAL_MISSING" in refused.error["message"]
    anonymous = settled(calls(alice, remote, ("record", {"arguments": {"text": "c"}})))
    assert anonymous.status == "failed" and "refused our credentials (HTTP 401)" in anonymous.error["message"]
    assert LedgerEntry.objects.get(task=anonymous).attempts == 1  # not retried
    assert remote.stats()["effects"]["record"] == 1
    assert not LedgerEntry.objects.filter(result__icontains="s3cret").exists()
