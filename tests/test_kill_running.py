"""The emergency stop of a running step (issue 18), with real worker processes and a real
local HTTP server as the tools' remote (tests/sink.py), which counts calls and the
connections its callers drop. The kill of tasks nobody runs: steering_app/tests/test_kill.py."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from conftest import FAST_LEASES, WORKER, settled, wait_until
from ledger_app.models import LedgerEntry
from steering_app.models import InputRequest, SteeringCommand
from steering_app.tests.test_kill import assert_killed, kill
from tasks_app.access import console
from tasks_app.actions import do_create_task
from tasks_app.models import Task
from tasks_app.operators import do_redrive_task
from tests.test_ledger import Sink
from tests.test_remote_mcp import Remote

pytestmark = pytest.mark.django_db(transaction=True)

FAST = {**FAST_LEASES, "SECURITY_HTTP_ALLOWLIST": "127.0.0.1"}


def calls(alice, *urls: str) -> Task:
    """A task that POSTs to each url in turn, one step each, through the ledger."""
    return do_create_task(
        console(alice.tenant, "user:test"),
        agent="tool_calls",
        input={
            "calls": [
                {"tool": "http.request", "args": {"url": url, "json": {"n": n}, "timeoutSeconds": 600}}
                for n, url in enumerate(urls)
            ]
        },
    )[0]


def holder_pid(task: Task) -> int:
    owner = wait_until(
        lambda: Task.objects.values_list("lease_owner", flat=True).get(id=task.id),
        timeout=30,
        what="a worker to hold the task",
    )
    return int(owner.rsplit(":", 1)[1])


def threads(pid: int) -> int:
    return int(
        next(
            line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("Threads:")
        ).split()[1]
    )


def sockets(pid: int) -> set[str]:
    """The inodes of the process's open sockets."""
    links = (os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd"))
    return {link[len("socket:[") : -1] for link in links if link.startswith("socket:[")}


def connected_to(pid: int, port: int) -> set[str]:
    """The inodes of the process's TCP sockets connected to `port` on 127.0.0.1."""
    rows = (line.split() for line in Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:])
    return {row[9] for row in rows if int(row[2].rsplit(":", 1)[1], 16) == port} & sockets(pid)


def test_a_step_stuck_in_a_ten_minute_call_is_killed_and_its_worker_runs_the_next_task(alice, processes):
    sink = Sink(processes)
    processes.worker(**FAST)
    task = calls(alice, f"{sink.url}/effects?hang=600")
    wait_until(lambda: sink.stats()["hanging"] == 1, timeout=60, what="the call to be in flight")
    pid = holder_pid(task)
    threads_in_call, the_call = threads(pid), connected_to(pid, sink.port)
    assert len(the_call) == 1

    answer = kill(alice, task, reason="runaway agent")
    assert answer.status_code == 202, answer.content
    assert answer.json()["status"] == "applied" and answer.json()["killPolicy"]["cut"][0] == "http.request"
    assert_killed(task.id, "runaway agent")  # at once: the command's own transaction ended it
    # The worker cut the call: the remote sees its caller hang up (not 10 minutes later).
    wait_until(lambda: sink.stats()["dropped"] == 1, timeout=30, what="the worker to drop the connection")
    wait_until(
        lambda: "its step was cut and nothing of it committed" in processes.logs(), timeout=30, what="the slice to end"
    )
    entry = LedgerEntry.objects.get(task=task)
    assert entry.status == "unknown"  # it may have taken effect: reconciled before anything re-sends it
    assert not Task.objects.get(id=task.id).steps.exists()  # nothing of the step committed

    # The same process goes on, with nothing left behind by the cut call.
    after = settled(calls(alice, f"{sink.url}/effects"))
    assert after.status == "completed", after.error
    assert int(after.steps.get().worker.rsplit(":", 1)[1]) == pid  # not a replacement process
    # (Its database connections stay open from slice to slice: the cut call's socket is what must be gone.)
    assert threads(pid) <= threads_in_call and not the_call & sockets(pid)
    assert sink.stats()["posts"] == 2 and Task.objects.get(id=task.id).status == "cancelled"


def test_a_call_that_must_finish_completes_and_the_task_stops_right_after_it_once(
    alice, processes, settings, monkeypatch
):
    sink = Sink(processes)
    # http.request stands in for payment.create; every process reads the one Kill Policy.
    monkeypatch.setitem(settings.RUNTIME["kill"], "finish_first", ["http.request"])
    processes.worker(**FAST, KILL_FINISH_FIRST="http.request")
    task = calls(alice, f"{sink.url}/effects?hang=8", f"{sink.url}/effects")
    wait_until(lambda: sink.stats()["hanging"] == 1, timeout=60, what="the call to be in flight")

    answer = kill(alice, task, reason="wrong account")
    assert answer.status_code == 202, answer.content
    assert answer.json()["status"] == "pending"
    assert "waiting for http.request to return" in answer.json()["outcome"]
    assert Task.objects.get(id=task.id).status == "working"  # the call runs on

    wait_until(lambda: Task.objects.get(id=task.id).status == "cancelled", timeout=60, what="the task to stop")
    assert_killed(task.id, "wrong account")
    stats = sink.stats()
    assert stats["posts"] == 1 and stats["dropped"] == 0  # it finished, and the next call never started
    entry = LedgerEntry.objects.get(task=task)
    assert entry.status == "succeeded" and entry.result["status"] == 201  # its answer is recorded
    assert SteeringCommand.objects.get(task=task, type="kill").status == "applied"


def test_a_call_cut_by_a_kill_is_confirmed_by_a_person_before_a_redrive_can_send_it_again(alice, processes):
    sink = Sink(processes)
    processes.worker(**FAST)
    task = calls(alice, f"{sink.url}/effects?hang=600")  # no reconcileUrl: the remote cannot be asked
    wait_until(lambda: sink.stats()["hanging"] == 1, timeout=60, what="the call to be in flight")
    assert kill(alice, task, reason="looked wrong").status_code == 202
    wait_until(lambda: sink.stats()["dropped"] == 1, timeout=30, what="the worker to drop the connection")
    entry = LedgerEntry.objects.get(task=task)
    assert entry.status == "unknown"

    do_redrive_task(task.id, who=console(task.tenant, "admin:root"), reason="the kill was a mistake")
    question = wait_until(
        lambda: InputRequest.objects.filter(task=task, key=f"confirm-{entry.key}").first(),
        timeout=60,
        what="the redriven step to ask a person about the cut call",
    )
    assert Task.objects.get(id=task.id).status == "input_required"
    assert sink.stats()["posts"] == 1  # not re-sent blindly

    answer = alice.client().post(f"/runtime/tasks/{task.id}/inputs/{question.key}", {"answer": "done"}, format="json")
    assert answer.status_code == 202, answer.content
    task = settled(task)
    assert task.status == "completed", task.error
    stats = sink.stats()
    assert stats["posts"] == 1 and list(stats["perKey"].values()) == [1]
    assert LedgerEntry.objects.get(task=task).status == "succeeded"


def test_without_the_doorbell_the_lease_tells_the_worker_at_its_next_beat(alice, processes, settings):
    sink = Sink(processes)
    processes.worker(**FAST)  # heartbeat 1 s
    settings.REDIS_URL = ""  # this side rings no doorbell: as if its message were lost
    task = calls(alice, f"{sink.url}/effects?hang=600")
    wait_until(lambda: sink.stats()["hanging"] == 1, timeout=60, what="the call to be in flight")
    assert kill(alice, task, reason="no doorbell").status_code == 202
    wait_until(lambda: sink.stats()["dropped"] == 1, timeout=30, what="the worker to drop the connection")
    assert "killed (lease); cutting its step" in processes.logs()
    assert LedgerEntry.objects.get(task=task).status == "unknown"


def test_a_kill_cuts_a_call_to_a_tool_on_a_remote_mcp_server_and_the_worker_goes_on(alice, processes):
    remote = Remote(processes)
    processes.worker(**FAST)
    task = do_create_task(
        console(alice.tenant, "user:test"),
        agent="tool_calls",
        input={
            "calls": [
                {
                    "tool": "mcp.call",
                    "args": {
                        "server": remote.mcp,
                        "tool": "slow",
                        "arguments": {"seconds": 600},
                        "timeoutSeconds": 600,
                    },
                }
            ]
        },
    )[0]
    wait_until(
        lambda: remote.stats()["effects"].get("slow_started") == 1, timeout=60, what="the remote tool to be running"
    )
    pid = holder_pid(task)
    assert kill(alice, task, reason="remote hung").status_code == 202
    wait_until(
        lambda: "its step was cut and nothing of it committed" in processes.logs(),
        timeout=30,
        what="the worker to cut the call (the SDK's event loop, in the slice's thread)",
    )
    assert LedgerEntry.objects.get(task=task).status == "unknown"  # mcp.call cannot be asked: a person confirms

    after = settled(do_create_task(console(alice.tenant, "user:test"), agent="noop", input={"steps": 2})[0])
    assert after.status == "completed" and {int(s.worker.rsplit(":", 1)[1]) for s in after.steps.all()} == {pid}
    assert remote.stats()["effects"].get("slow", 0) == 0


def test_a_call_that_must_finish_and_fails_still_ends_the_task_killed_not_failed(
    alice, processes, settings, monkeypatch
):
    sink = Sink(processes)
    monkeypatch.setitem(settings.RUNTIME["kill"], "finish_first", ["http.request"])
    processes.worker(**FAST, KILL_FINISH_FIRST="http.request")
    # The remote holds the call, then refuses it for good (a declined payment): the step fails.
    task = calls(alice, f"{sink.url}/effects?hang=8&status=402", f"{sink.url}/effects")
    wait_until(lambda: sink.stats()["hanging"] == 1, timeout=60, what="the call to be in flight")

    answer = kill(alice, task, reason="wrong account")
    assert answer.status_code == 202, answer.content
    assert answer.json()["status"] == "pending"  # waiting for the call to return, then stopping

    wait_until(
        lambda: Task.objects.get(id=task.id).status in ("cancelled", "failed"), timeout=60, what="the task to stop"
    )
    assert_killed(task.id, "wrong account")  # the accepted kill is what ended it, not the step's failure
    assert SteeringCommand.objects.get(task=task, type="kill").status == "applied"
    assert LedgerEntry.objects.get(task=task).status == "failed"  # the remote's refusal is recorded
    assert sink.stats()["posts"] == 1


def test_a_must_finish_call_sent_again_after_reconciliation_is_waited_for_too(
    alice, processes, settings, monkeypatch, tmp_path
):
    sink = Sink(processes)
    monkeypatch.setitem(settings.RUNTIME["kill"], "finish_first", ["http.request"])
    marker = tmp_path / "crashed"
    # The first worker process dies with the call's row started and nothing sent; the next
    # asks the remote by key, hears "never happened", and sends the call (under the same key).
    processes.worker(**FAST, KILL_FINISH_FIRST="http.request", RUNTIME_FAULT_INJECTION=f"ledger:before_call:{marker}")
    processes.beat(**FAST)
    task = do_create_task(
        console(alice.tenant, "user:test"),
        agent="tool_calls",
        input={
            "calls": [
                {
                    "tool": "http.request",
                    "args": {
                        "url": f"{sink.url}/effects?hang=8",
                        "json": {"n": 0},
                        "reconcileUrl": f"{sink.url}/effects/{{key}}",
                    },
                }
            ]
        },
    )[0]
    wait_until(lambda: sink.stats()["hanging"] == 1, timeout=90, what="the call to be in flight again")
    assert marker.exists()

    answer = kill(alice, task, reason="wrong account")
    assert answer.status_code == 202, answer.content
    assert answer.json()["status"] == "pending"  # it must finish: the kill waits for it, as for a first send
    wait_until(lambda: Task.objects.get(id=task.id).status == "cancelled", timeout=60, what="the task to stop")
    assert_killed(task.id, "wrong account")
    entry = LedgerEntry.objects.get(task=task)
    assert entry.status == "succeeded" and entry.result["status"] == 201  # its answer is recorded
    assert sink.stats()["posts"] == 1


def test_a_kill_waiting_on_a_must_finish_call_of_a_frozen_worker_ends_the_task_when_its_lease_runs_out(
    alice, processes, settings, monkeypatch
):
    import signal

    sink = Sink(processes)
    monkeypatch.setitem(settings.RUNTIME["kill"], "finish_first", ["http.request"])
    worker = processes.worker(**FAST, KILL_FINISH_FIRST="http.request")
    processes.beat(**FAST)
    task = calls(alice, f"{sink.url}/effects?hang=600")
    wait_until(lambda: sink.stats()["hanging"] == 1, timeout=60, what="the call to be in flight")
    assert kill(alice, task, reason="wrong account").json()["status"] == "pending"
    processes.kill(worker, signal.SIGSTOP)  # the only steps worker freezes: the call never returns to it
    # The reaper's own worker (maintenance queue only) is alive.
    processes.start("maintenance", [sys.executable, "-m", *WORKER[:4], "-Q", "maintenance", *WORKER[6:], "1"], **FAST)

    # The kill waited for that worker; lost, it cannot stop the task: the reaper does, at once,
    # instead of handing a killed task to a next worker (there may be none) just to end it.
    wait_until(
        lambda: Task.objects.get(id=task.id).status == "cancelled",
        timeout=30,
        what="the killed task to end once its worker's lease ran out",
    )
    assert_killed(task.id, "wrong account")
    assert LedgerEntry.objects.get(task=task).status == "unknown"  # in flight when lost: reconciled, never re-sent
    assert SteeringCommand.objects.get(task=task, type="kill").status == "applied"
