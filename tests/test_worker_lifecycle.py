"""Leases over a worker's life (issue 12): a CPU-starved worker keeps its lease through a long
remote call, a hung step is abandoned at its deadline, a thawed zombie never sends, and a
worker told to stop (SIGTERM) hands its task over at once. Real worker processes; effects
are counted by independent receivers (tests/mcp_remote.py, tests/sink.py)."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import termios
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import FAST_LEASES, WORKER, Processes, purge_queues, settled, wait_until
from ledger_app.models import LedgerEntry
from steering_app.models import InputRequest
from tasks_app.access import console
from tasks_app.actions import do_create_task
from tasks_app.models import Step, Task
from tests.test_ledger import Sink, webhook
from tests.test_remote_mcp import Remote

pytestmark = pytest.mark.django_db(transaction=True)

FAST = {**FAST_LEASES, "SECURITY_HTTP_ALLOWLIST": "127.0.0.1"}


def log_of(proc: subprocess.Popen[bytes]) -> str:
    return Path(proc.log_path).read_text(errors="replace")  # type: ignore[attr-defined]


def worker_on(
    processes: Processes, queue: str, *, wait: bool = True, log_level: str = "INFO", **env: str
) -> subprocess.Popen[bytes]:
    """A worker of one queue (slices: "steps"; the beat's jobs: "maintenance"), once ready
    (or at once: wait=False)."""
    replace = {"steps,maintenance": queue, "INFO": log_level}
    args = [
        sys.executable,
        "-m",
        *(replace.get(arg, arg) for arg in WORKER),
        "1",
        "-n",
        f"{queue}-{len(processes.procs)}@%h",
    ]
    proc = processes.start("worker", args, **env)
    if wait:
        wait_until(lambda: " ready." in log_of(proc), timeout=60, what="the worker to be ready")
    return proc


@contextlib.contextmanager
def cpu_starved(processes: Processes, proc: subprocess.Popen[bytes]) -> Iterator[None]:
    """Starve `proc`'s process group of CPU: busy loops at nice 0, three per core, while it
    runs at nice 10 (a CPU share of a few percent: measured, the lease was lost without
    the fix and kept with it). With autogroup scheduling (Linux desktops and many servers)
    nice only weighs inside a session, so its session is niced instead."""
    burners = [
        processes.start("burner", [sys.executable, "-c", "while True: pass"]) for _ in range(3 * (os.cpu_count() or 1))
    ]
    os.setpriority(os.PRIO_PGRP, proc.pid, 10)
    with contextlib.suppress(OSError):  # no autogroup here: the plain nice above does it
        Path(f"/proc/{proc.pid}/autogroup").write_text("10")
    try:
        yield
    finally:
        for burner in burners:
            processes.kill(burner)


def test_a_cpu_starved_worker_keeps_its_lease_through_a_remote_call_of_several_leases(alice, processes):
    remote = Remote(processes)
    starved = worker_on(processes, "steps", **FAST)
    worker_on(processes, "maintenance", **FAST)  # the reaper's scans run at full speed
    processes.beat(**FAST)
    with cpu_starved(processes, starved):
        task, _ = do_create_task(
            console(alice.tenant, "user:test"),
            agent="tool_calls",
            input={
                "calls": [
                    {
                        "tool": "mcp.call",
                        "args": {
                            "server": remote.mcp,
                            "tool": "slow",
                            "arguments": {"seconds": 12},
                            "timeoutSeconds": 120,
                        },
                    }
                ]
            },
        )
        # A lost lease shows as a recovery long before the task settles: stop there.
        wait_until(
            lambda: (
                (t := Task.objects.get(id=task.id)).status in ("completed", "failed", "input_required") or t.recoveries
            ),
            timeout=240,
            what="the task to complete or lose its lease",
        )
    task = settled(task)
    assert task.recoveries == 0 and task.lease_epoch == 1, "the lease was lost mid-call"
    assert task.status == "completed", task.error
    assert not InputRequest.objects.filter(task=task).exists()
    assert task.result["results"][0]["structuredContent"] == {"result": "slow done"}
    entry = LedgerEntry.objects.get(task=task)
    assert entry.status == "succeeded" and entry.attempts == 1
    assert remote.stats()["effects"] == {"slow_started": 1, "slow": 1}


def stopped(pid: int) -> bool:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"


def worker_freezing_at(processes: Processes, tmp_path: Path, point: str, **env: str) -> Path:
    """A worker that stops itself (SIGSTOP) at fault point `point`, and beat; the marker file
    it writes its pid to when it does."""
    marker = tmp_path / "frozen"
    processes.worker(**env, RUNTIME_FAULT_INJECTION=f"freeze:{point}:{marker}")
    processes.beat(**env)
    return marker


def frozen(marker: Path) -> int:
    """The pid of the worker frozen at its fault point, once it is stopped."""
    wait_until(marker.exists, timeout=60, what="the worker to freeze at its fault point")
    zombie = int(wait_until(marker.read_text, timeout=5, what="the frozen pid"))
    wait_until(lambda: stopped(zombie), timeout=5, what="the worker to be stopped")
    return zombie


def thaw(processes: Processes, zombie: int) -> None:
    """SIGCONT: it wakes where it stopped, about to send, and must give its slice up."""
    os.kill(zombie, signal.SIGCONT)
    wait_until(
        lambda: not stopped(zombie) and "lease lost, slice abandoned" in processes.logs(),
        timeout=30,
        what="the thawed worker to give up its slice",
    )


# Right before a call (the lease is confirmed after it), and after the lease was confirmed
# for the call: the soak's duplicate (bench/soak.py, a freeze) was the second, where the next
# owner found the call's row started, asked the sink (404) and sent it, and the thawed
# worker sent it again.
@pytest.mark.parametrize(
    ("point", "refused_saying"),
    [("ledger:before_call", None), ("ledger:confirmed", "ran out before the call was sent")],
    ids=["before_call", "lease_confirmed"],
)
def test_a_worker_frozen_at_a_call_and_thawed_after_a_takeover_never_sends(
    alice, processes, tmp_path, point, refused_saying
):
    sink = Sink(processes)
    marker = worker_freezing_at(processes, tmp_path, point, **FAST)
    task = webhook(alice, sink, count=1)
    zombie = frozen(marker)

    processes.worker(**FAST)  # takes over once the frozen worker's lease runs out
    task = settled(task)
    assert task.status == "completed" and task.recoveries == 1, task.error
    assert sink.stats()["posts"] == 1  # the new owner asked the sink by key, then made the call

    thaw(processes, zombie)
    stats = sink.stats()
    assert stats["posts"] == 1 and list(stats["perKey"].values()) == [1], stats  # the zombie never sent
    if refused_saying:
        assert refused_saying in processes.logs()


def test_a_worker_frozen_after_confirming_its_lease_for_a_remote_tool_and_thawed_after_a_takeover_never_calls(
    alice, processes, tmp_path
):
    # As above, for mcp.call: its own HTTP client (the MCP SDK's) sent the tools/call of a
    # worker thawed after a takeover. The new owner found the call's row started and, the
    # remote having no way to be asked by key, asked a person; the remote ran it all the same.
    remote = Remote(processes)
    marker = worker_freezing_at(processes, tmp_path, "ledger:confirmed", **FAST)
    task, _ = do_create_task(
        console(alice.tenant, "user:test"),
        agent="tool_calls",
        input={
            "calls": [
                {"tool": "mcp.call", "args": {"server": remote.mcp, "tool": "record", "arguments": {"text": "a"}}}
            ]
        },
    )
    zombie = frozen(marker)

    processes.worker(**FAST)  # takes over once the frozen worker's lease runs out
    wait_until(
        lambda: Task.objects.get(id=task.id).status == "input_required",
        timeout=60,
        what="the new owner to ask whether the call it found started took effect",
    )
    assert remote.stats()["effects"] == {}

    thaw(processes, zombie)
    assert remote.stats()["effects"] == {}  # the zombie never called
    assert "ran out before the call was sent" in processes.logs()


def test_a_worker_frozen_after_confirming_its_lease_for_a_mail_and_thawed_after_a_takeover_never_sends_it(
    alice, processes, tmp_path
):
    # As above, for email.send (SMTP, which cannot be asked afterwards): the thawed worker
    # delivered the mail the new owner had asked a person about.
    from tests.test_approvals import smtp_sink

    port, mail = smtp_sink(processes, tmp_path)
    env = {**FAST, "EMAIL_HOST": "127.0.0.1", "EMAIL_PORT": str(port), "SECURITY_REQUIRE_APPROVAL": "content.publish"}
    marker = worker_freezing_at(processes, tmp_path, "ledger:confirmed", **env)
    args = {"to": ["legal@example.com"], "subject": "report", "body": "done"}
    task, _ = do_create_task(
        console(alice.tenant, "user:test"), agent="tool_calls", input={"calls": [{"tool": "email.send", "args": args}]}
    )
    zombie = frozen(marker)

    processes.worker(**env)  # takes over once the frozen worker's lease runs out
    wait_until(
        lambda: Task.objects.get(id=task.id).status == "input_required",
        timeout=60,
        what="the new owner to ask whether the mail it found started went out",
    )
    assert mail.read_text() == ""

    thaw(processes, zombie)
    assert mail.read_text() == ""  # the zombie never sent it
    assert "ran out before the call was sent" in processes.logs()


# Tools from another package (tasks_app/plugins.py) with their own HTTP client: `sender.post`
# checks nothing about leases (what a plugin author writes first); `sender.careful` prepares
# slowly (here: its worker is frozen mid-way, once) and asks tools.before_send before it sends.
# Installed as pip would leave them (a module and its dist-info with the entry points), in a
# folder of the test's own.
SENDER_PLUGIN = """
import json
import os
import signal
import urllib.error
import urllib.request

from tasks_app.agents.tools import DONE, NOT_DONE, Tool, before_send


def _post(args, key, timeout):
    request = urllib.request.Request(
        args["url"], data=b'{"from": "plugin"}', method="POST",
        headers={"Idempotency-Key": key, "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def _careful(args, key, timeout):
    if not os.path.exists(args["freezeMarker"]):  # the first time: frozen while preparing
        with open(args["freezeMarker"], "w") as marker:
            marker.write(str(os.getpid()))
        os.kill(os.getpid(), signal.SIGSTOP)
    before_send()
    return _post(args, key, timeout)


def _reconcile(args, key):
    try:
        with urllib.request.urlopen(f"{args['url']}/{key}", timeout=10) as response:
            return DONE, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return (NOT_DONE, None) if exc.code == 404 else None


POST = Tool(name="sender.post", input_schema={"type": "object"}, call=_post, reconcile=_reconcile)
CAREFUL = Tool(name="sender.careful", input_schema={"type": "object"}, call=_careful, reconcile=_reconcile)
"""


def sender_plugin(tmp_path: Path) -> Path:
    site = tmp_path / "site"
    info = site / "runtime_sender-0.1.dist-info"
    info.mkdir(parents=True)
    (site / "runtime_sender.py").write_text(SENDER_PLUGIN)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: runtime-sender\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        "[long_task_runtime.tools]\nsender.post = runtime_sender:POST\nsender.careful = runtime_sender:CAREFUL\n"
    )
    return site


@pytest.mark.parametrize("tool", ["sender.post", "sender.careful"], ids=["handed_over", "while_preparing"])
def test_a_worker_frozen_in_a_plugins_tool_call_and_thawed_after_a_takeover_never_sends(
    alice, processes, tmp_path, tool
):
    # As for the built-in tools above, whose clients check the confirmed lease as they send: a
    # plugin's tool was handed the call all the same, and sent it a second time.
    sink = Sink(processes)
    env = {**FAST, "PYTHONPATH": str(sender_plugin(tmp_path))}
    if tool == "sender.post":  # frozen after the lease was confirmed for the call, before it is handed over
        marker = worker_freezing_at(processes, tmp_path, "ledger:confirmed", **env)
    else:  # frozen by the tool itself, inside its call
        marker = tmp_path / "frozen"
        processes.worker(**env)
        processes.beat(**env)
    args = {"url": f"{sink.url}/effects", "freezeMarker": str(marker)}
    task, _ = do_create_task(
        console(alice.tenant, "user:test"), agent="tool_calls", input={"calls": [{"tool": tool, "args": args}]}
    )
    zombie = frozen(marker)

    processes.worker(**env)  # takes over once the frozen worker's lease runs out
    task = settled(task)
    assert task.status == "completed" and task.recoveries == 1, task.error
    assert sink.stats()["posts"] == 1  # the new owner asked the sink by key (404), then called

    thaw(processes, zombie)
    stats = sink.stats()
    assert stats["posts"] == 1 and list(stats["perKey"].values()) == [1], stats  # the zombie never sent
    assert "ran out before the call was sent" in processes.logs()


def pool_pids(worker: subprocess.Popen[bytes]) -> set[int]:
    return {int(pid) for pid in Path(f"/proc/{worker.pid}/task/{worker.pid}/children").read_text().split()}


def test_a_step_that_always_hangs_is_abandoned_at_its_deadline_until_it_dead_letters(alice, processes):
    env = {**FAST, "RUNTIME_STEP_SECONDS": "2"}
    worker = processes.worker(**env)
    processes.beat(**env)
    hanging, _ = do_create_task(
        console(alice.tenant, "user:test"), agent="noop", input={"steps": 1, "sleepMs": 600_000}
    )
    first_pool = wait_until(lambda: pool_pids(worker), timeout=30, what="the pool process")
    task = wait_until(
        lambda: (t := Task.objects.get(id=hanging.id)).status == "dead_lettered" and t,
        timeout=120,
        what="the hanging task to be dead-lettered",
    )
    assert task.recoveries == 4  # max_recoveries is 3: abandoned four times, then held for an operator
    assert task.error["code"] == "max_recoveries_exceeded"
    assert task.error["cause"] == {"code": "step_deadline_exceeded", "step": "noop-1", "deadlineSeconds": 2}
    reasons = list(
        task.audit_records.filter(actor__startswith="worker:", data__cause__step="noop-1").values_list(
            "reason", flat=True
        )
    )
    assert len(reasons) == 4 and all("step noop-1 ran past its deadline of 2s" in r for r in reasons)

    # The worker is healthy: its stuck pool processes were replaced, and it runs the next task.
    assert worker.poll() is None and not pool_pids(worker) & first_pool
    after = settled(do_create_task(console(alice.tenant, "user:test"), agent="noop", input={"steps": 3})[0])
    assert after.status == "completed" and after.recoveries == 0


def held_by(task: Task, worker: subprocess.Popen[bytes]) -> bool:
    """True while a pool process of `worker` (its process group) holds the task's lease."""
    owner = Task.objects.values_list("lease_owner", flat=True).get(id=task.id)
    with contextlib.suppress(ProcessLookupError):
        return bool(owner) and os.getpgid(int(owner.rsplit(":", 1)[1])) == worker.pid
    return False


@pytest.mark.parametrize("whole_group", [False, True], ids=["main-process", "process-group"])
def test_a_worker_told_to_stop_hands_its_task_over_before_its_lease_would_expire(alice, processes, whole_group):
    # No beat: nothing recovers an expired lease here, so only the stopping worker's own
    # handover can move the task. Slices that would run a minute and a 6 s lease make the
    # order below mean something: the handover is not the slice's end or the lease's expiry.
    env = {**FAST, "RUNTIME_LEASE_SECONDS": "6", "RUNTIME_SLICE_SECONDS": "60", "RUNTIME_SLICE_STEPS": "1000"}
    stopping = processes.worker(**env)
    task, _ = do_create_task(console(alice.tenant, "user:test"), agent="noop", input={"steps": 150, "sleepMs": 100})
    wait_until(
        lambda: Task.objects.get(id=task.id).steps_done >= 5 and held_by(task, stopping),
        timeout=60,
        what="the first worker to be under way",
    )
    other = processes.worker(**env)
    wait_until(lambda: " ready." in log_of(other), timeout=60, what="the second worker to be ready")
    at_signal = Task.objects.get(id=task.id)

    # docker stop and Kubernetes signal the main process; systemd (by default) every process.
    (os.killpg if whole_group else os.kill)(stopping.pid, signal.SIGTERM)
    assert stopping.wait(timeout=60) == 0  # a warm shutdown that completed
    wait_until(lambda: held_by(task, other), timeout=30, what="the other worker to take the task over")
    task = settled(task)
    assert task.status == "completed" and task.result == {"steps": 150}
    assert task.recoveries == 0  # handed over, not recovered after a crash
    steps = list(
        Step.objects.filter(task=task).order_by("sequence").values_list("sequence", "attempt", "worker", "started_at")
    )
    assert [(seq, attempt) for seq, attempt, _, _ in steps] == [(n, 1) for n in range(1, 151)]  # nothing re-ran
    taken_over = next(
        started for _, _, worker, started in steps if worker != at_signal.lease_owner and started > at_signal.updated_at
    )
    assert taken_over < at_signal.lease_expires_at  # before the stopping worker's lease could have run out


def test_a_stopping_worker_reads_its_last_slice_result_the_moment_it_is_written():
    """A worker told to stop drains its pool: its result handler looks at each pool
    process's pipe until the slice in hand has answered. It used to sleep 0.5 s whenever
    it found the pipe empty, so a slice that handed its task over a few milliseconds after
    the signal kept the worker 0.5 s longer, and its replacement waited for it (a stop took
    0.60-0.70 s, measured, with the lease given back after 0.02-0.09 s). Here the pipe is
    a real one and the handler Celery's own (runtime_site/patches/prefork.py, patch 4)."""
    import threading
    import time
    from types import SimpleNamespace

    from billiard.connection import Pipe
    from celery.concurrency import asynpool

    import runtime_site.celery  # noqa: F401  (installs the patches, as every worker does)

    reader, writer = Pipe(duplex=False)
    handler = asynpool.ResultHandler.__new__(asynpool.ResultHandler)  # only the draining part is used
    handler._hub = None  # no message half read by the event loop
    pool_process = SimpleNamespace(outq=SimpleNamespace(_reader=reader))
    results: list[tuple[float, object]] = []
    written: list[float] = []

    def answer() -> None:
        written.append(time.monotonic())
        writer.send((1, ("the slice's result",)))

    started = time.monotonic()
    threading.Timer(0.05, answer).start()  # the slice answers while the handler looks
    deadline = started + 10
    while not results and time.monotonic() < deadline:
        handler._flush_outqueue(
            reader.fileno(),
            lambda fd: None,
            {reader.fileno(): pool_process},
            lambda r: results.append((time.monotonic(), r)),
        )
    assert results and results[0][1] == (1, ("the slice's result",))
    # Read before the earliest moment the old handler looked again: the end of its blind 0.5 s
    # sleep (celery 5.7.0), begun when it first found the pipe empty, before the answer came.
    # The widest margin there is: 0.45 s of scheduling delay, where it allowed 0.2 s.
    assert results[0][0] < started + 0.5


def unread_pipe_bytes(pid: int) -> int:
    """Bytes waiting in the pipes of a process (a pool process's job queue) that it has not read."""
    waiting = 0
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            if not os.readlink(fd).startswith("pipe:"):
                continue
            pipe = os.open(fd, os.O_RDONLY | os.O_NONBLOCK)  # the same pipe, opened anew
            try:
                waiting += struct.unpack("i", fcntl.ioctl(pipe, termios.FIONREAD, b"\0" * 4))[0]
            finally:
                os.close(pipe)
    return waiting


def unacked() -> list[tuple[str, str, str]]:
    """Messages delivered to a worker and not yet acknowledged (kombu's unacked hash): each
    one's message id, task name and arguments."""
    import redis
    from django.conf import settings

    hashed = redis.Redis.from_url(settings.REDIS_URL).hvals(f"{settings.RUNTIME_DEPLOYMENT}:unacked")
    headers = [json.loads(raw)[0]["headers"] for raw in hashed]
    return [(h.get("id", "?"), h.get("task", "?"), h.get("argsrepr", "?")) for h in headers]


def test_the_purge_before_each_test_drops_what_a_killed_worker_left_unacknowledged(alice, processes):
    # In CI the unacked hash held entries of an earlier test's worker, killed with a message in
    # hand: the purge every `processes` test starts with named the hash's keys with the
    # deployment's prefix twice, and kept them. Four hours on (the visibility timeout) a live
    # worker would have put them back in a later test's queue.
    worker = processes.worker(**FAST)
    task, _ = do_create_task(console(alice.tenant, "user:test"), agent="noop", input={"steps": 50, "sleepMs": 200})
    wait_until(lambda: [m for m in unacked() if str(task.id) in m[2]], timeout=60, what="the worker to hold the slice")
    processes.kill(worker)  # kill -9 with the message in hand: nobody will acknowledge it
    assert [m for m in unacked() if str(task.id) in m[2]]

    purge_queues()
    assert unacked() == []


def received_ids(log: str) -> list[str]:
    return re.findall(r"Task tasks\.run_task_slice\[([0-9a-f-]+)\] received", log)


def test_a_worker_told_to_stop_with_a_message_in_hand_runs_it_once_and_a_starting_worker_takes_over(alice, processes):
    # A rolling restart: the stopping worker has just been handed a slice (the job is written
    # to its pool process, whose "accepted" reply it has not read yet) and its replacement is
    # still starting. Its pool process is held stopped so that moment lasts: Celery's shutdown
    # used to drop such a job from the pool's books, wait 30 s for the pool process, which ran
    # it anyway and waited for its result to be read, and give the message back unacknowledged,
    # to be run a second time by the next worker.
    env = {**FAST, "RUNTIME_SLICE_STEPS": "1000"}
    stopping = worker_on(processes, "steps", log_level="DEBUG", **env)
    (pool,) = wait_until(lambda: pool_pids(stopping), timeout=30, what="the pool process")
    first, _ = do_create_task(console(alice.tenant, "user:test"), agent="noop", input={"steps": 1})
    assert settled(first).status == "completed"  # the pool process is up (the worker is ready before it)
    # ... and has handed its result back, so the main process acknowledged the message: a
    # pool process stopped between its commit and that left the one prefetch slot taken, and
    # the next slice was never delivered (CI).
    wait_until(lambda: not unacked(), timeout=30, what=lambda: f"the first slice acknowledged (unacked: {unacked()})")
    os.kill(pool, signal.SIGSTOP)
    wait_until(lambda: stopped(pool), timeout=5, what="the pool process to be stopped")
    task, _ = do_create_task(console(alice.tenant, "user:test"), agent="noop", input={"steps": 20, "sleepMs": 50})
    wait_until(lambda: unread_pipe_bytes(pool) > 4, timeout=30, what="the slice to be written to the pool process")
    in_hand = received_ids(log_of(stopping))[-1]

    os.kill(stopping.pid, signal.SIGTERM)  # the main process, as docker stop and Kubernetes do
    starting = worker_on(processes, "steps", wait=False, **env)
    wait_until(
        lambda: "Worker: Stopping Pool" in log_of(stopping), timeout=30, what="the stopping worker to close its pool"
    )
    os.kill(pool, signal.SIGCONT)  # it reads the job now: too late for the worker to know of it before
    assert stopping.wait(timeout=90) == 0  # a warm shutdown that completed
    assert Task.objects.get(id=task.id).lease_owner != f"{socket.gethostname()}:{pool}"  # handed over, not held

    task = settled(task)
    assert task.status == "completed" and task.result == {"steps": 20} and task.recoveries == 0
    wait_until(
        lambda: not messages_in("steps") and not unacked(),
        timeout=30,
        what=lambda: f"the queue to be empty (waiting: {messages_in('steps')}; unacked: {unacked()})",
    )
    assert in_hand not in received_ids(log_of(starting))  # acknowledged once run, never given back
    assert received_ids(log_of(stopping))[-1] == in_hand  # and it took no other
    steps = list(Step.objects.filter(task=task).order_by("sequence").values_list("sequence", "attempt", "worker"))
    assert [(seq, attempt) for seq, attempt, _ in steps] == [(n, 1) for n in range(1, 21)]
    # The stopping worker's slice yielded before its first step: the starting worker ran them all.
    starting_pool = {f"{socket.gethostname()}:{pid}" for pid in pool_pids(starting)}
    assert {worker for _, _, worker in steps} <= starting_pool


def messages_in(queue: str) -> int:
    """Messages waiting in a queue: its Redis lists, one per priority bucket."""
    import redis
    from django.conf import settings

    client = redis.Redis.from_url(settings.REDIS_URL)
    return sum(
        client.llen(key)
        for key in client.keys(f"{settings.RUNTIME_DEPLOYMENT}:{queue}*")
        if client.type(key) == b"list"
    )


def test_a_recovering_task_whose_message_was_lost_is_rung_again_without_waiting_for_the_stall_scan(alice, processes):
    env = {**FAST, "RUNTIME_STALL_SECONDS": "600"}  # the stall scan alone would take ten minutes
    crashed = worker_on(processes, "steps", **env)
    worker_on(processes, "maintenance", **env)  # the reaper keeps scanning; nobody takes slices
    processes.beat(**env)
    task, _ = do_create_task(console(alice.tenant, "user:test"), agent="noop", input={"steps": 30, "sleepMs": 100})
    wait_until(lambda: Task.objects.get(id=task.id).steps_done >= 3, timeout=60, what="3 steps")
    processes.kill(crashed)
    wait_until(
        lambda: Task.objects.get(id=task.id).status == "recovering",
        timeout=30,
        what="the reaper to mark the task recovering",
    )
    wait_until(lambda: messages_in("steps"), timeout=10, what="the reaper's message in the queue")
    purge_queues()  # its message is gone, as with a worker (or broker) that died holding it
    assert messages_in("steps") == 0
    worker_on(processes, "steps", **env)
    task = settled(task)
    assert task.status == "completed" and task.result == {"steps": 30}
    assert task.recoveries == 1  # rung again, not recovered again


def test_a_step_stuck_in_a_c_call_that_holds_the_gil_still_meets_its_deadline(alice, processes, tmp_path):
    # The heartbeat thread cannot run while the step holds the GIL: neither the deadline nor
    # a renewal can come from it. The pool process must still end, and the worker live on.
    sink = Sink(processes)
    marker = tmp_path / "hung"
    env = {**FAST, "RUNTIME_STEP_SECONDS": "2"}
    stuck = worker_on(processes, "steps", **env, RUNTIME_FAULT_INJECTION=f"hang:ledger:before_call:{marker}")
    worker_on(processes, "maintenance", **env)  # the reaper runs elsewhere: the stuck worker has one process
    processes.beat(**env)
    task = webhook(alice, sink, count=1)
    hung = int(wait_until(lambda: marker.exists() and marker.read_text(), timeout=60, what="the step to hang"))
    wait_until(lambda: not Path(f"/proc/{hung}").exists(), timeout=60, what="the stuck pool process to end")
    task = settled(task, timeout=120)
    assert task.status == "completed" and task.recoveries == 1, task.error
    assert sink.stats()["posts"] == 1
    assert stuck.poll() is None  # the worker lives on, with a fresh pool process that runs the next task
    after = settled(do_create_task(console(alice.tenant, "user:test"), agent="noop", input={"steps": 3})[0])
    assert after.status == "completed" and after.recoveries == 0
