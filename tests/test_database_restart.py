"""Every endpoint of a real uvicorn process across a database restart (issue 12, defect 3):
after PostgreSQL ends its connections the next requests are answered normally; while the
database is down each is a 503 with Retry-After in the edge's error shape (a JSON-RPC error
on /mcp), never a 500; once it is back, normal answers within seconds. The same while it is
frozen (stopped with SIGSTOP, as a hung host or a partition that drops packets looks), each
503 within the web process's deadline for an answer.

The outage is real: the web process runs on a private PostgreSQL cluster (initdb in a
temporary folder, run as the postgres user on a free port) holding a copy of the test
database, which the test stops and starts. The shared server is never restarted."""

from __future__ import annotations

import contextlib
import getpass
import os
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
from django.db import connection
from psycopg.rows import dict_row

from conftest import Persona, Processes, database_url, free_port, wait_until
from mcp_server.protocol import MODERN, TASKS_EXT

pytestmark = pytest.mark.django_db(transaction=True)

UP = {
    "healthz": 200,
    "list": 200,
    "detail": 200,
    "audit": 200,
    "create": 201,
    "steer": 202,
    "cancel": 202,
    "events": 200,
    "mcp 2026-07-28": 200,
    "mcp 2025-11-25": 200,
    "dashboard": 200,
}


def session_for(persona: Persona) -> str:
    """A dashboard session, made the way signing in makes one (the web process reads it from the database)."""
    from django.contrib.auth import BACKEND_SESSION_KEY, HASH_SESSION_KEY, SESSION_KEY
    from django.contrib.sessions.backends.db import SessionStore

    session = SessionStore()
    session[SESSION_KEY] = str(persona.user.pk)
    session[BACKEND_SESSION_KEY] = "django.contrib.auth.backends.ModelBackend"
    session[HASH_SESSION_KEY] = persona.user.get_session_auth_hash()
    session.create()
    return session.session_key


def requests(
    base: str, persona: Persona, task_id: str, session: str, timeout: float = 60
) -> dict[str, Callable[[], httpx.Response]]:
    """One request per kind of endpoint, each on its own (they run in parallel)."""
    auth = {"Authorization": f"Bearer {persona.token}"}

    def api(**kwargs: Any) -> httpx.Client:
        return httpx.Client(base_url=base, headers=auth, timeout=timeout, **kwargs)

    def fresh_task(client: httpx.Client) -> str:
        created = client.post("/runtime/tasks", json={"agent": "noop", "input": {"steps": 1}})
        return created.json()["taskId"] if created.status_code == 201 else task_id

    def steer() -> httpx.Response:
        with api() as client:
            return client.post(
                f"/runtime/tasks/{fresh_task(client)}/steering",
                json={
                    "commandId": f"c-{uuid.uuid4().hex}",
                    "type": "set_priority",
                    "expectedVersion": 1,
                    "payload": {"priority": 3},
                },
            )

    def cancel() -> httpx.Response:
        with api() as client:
            return client.post(f"/runtime/tasks/{fresh_task(client)}/cancel", json={})

    def events() -> httpx.Response:
        with api() as client, client.stream("GET", f"/runtime/tasks/{task_id}/events") as response:
            if response.status_code == 200:  # the first event is the snapshot; then let go
                assert (
                    next(line for line in response.iter_lines() if line.startswith("event:")) == "event: task.snapshot"
                )
            else:
                response.read()
            return response

    def mcp_modern() -> httpx.Response:
        with api() as client:
            return client.post(
                "/mcp",
                headers={"MCP-Protocol-Version": MODERN, "Mcp-Method": "tasks/get", "Mcp-Name": task_id},
                json={
                    "jsonrpc": "2.0",
                    "id": 11,
                    "method": "tasks/get",
                    "params": {
                        "taskId": task_id,
                        "_meta": {
                            "io.modelcontextprotocol/protocolVersion": MODERN,
                            "io.modelcontextprotocol/clientCapabilities": {"extensions": {TASKS_EXT: {}}},
                        },
                    },
                },
            )

    def mcp_legacy() -> httpx.Response:
        with api() as client:
            return client.post("/mcp", json={"jsonrpc": "2.0", "id": 12, "method": "tasks/list", "params": {}})

    def get(path: str, **kwargs: Any) -> Callable[[], httpx.Response]:
        def call() -> httpx.Response:
            with api(**kwargs) as client:
                return client.get(path)

        return call

    def create() -> httpx.Response:
        with api() as client:
            return client.post("/runtime/tasks", json={"agent": "noop", "input": {"steps": 1}})

    return {
        "healthz": get("/healthz"),
        "list": get("/runtime/tasks"),
        "detail": get(f"/runtime/tasks/{task_id}"),
        "audit": get(f"/runtime/tasks/{task_id}/audit"),
        "create": create,
        "steer": steer,
        "cancel": cancel,
        "events": events,
        "mcp 2026-07-28": mcp_modern,
        "mcp 2025-11-25": mcp_legacy,
        "dashboard": get("/dashboard/tasks.json", cookies={"sessionid": session}),
    }


def probe(calls: dict[str, Callable[[], httpx.Response]]) -> dict[str, httpx.Response]:
    with ThreadPoolExecutor(max_workers=len(calls)) as pool:
        futures = {name: pool.submit(call) for name, call in calls.items()}
        return {name: future.result() for name, future in futures.items()}


def statuses(answers: dict[str, httpx.Response]) -> dict[str, int]:
    return {name: response.status_code for name, response in answers.items()}


def assert_unavailable(answers: dict[str, httpx.Response]) -> None:
    """Down: /healthz (the process is up) answers; everything else is a clean 503."""
    assert answers["healthz"].status_code == 200
    for name, response in answers.items():
        if name == "healthz":
            continue
        assert response.status_code == 503, (name, response.status_code, response.text[:300])
        assert int(response.headers["Retry-After"]) > 0, name
        body = response.json()
        if name.startswith("mcp"):
            assert body["jsonrpc"] == "2.0" and body["id"] == (11 if "2026" in name else 12), (name, body)
            assert body["error"]["code"] == -32003 and "unavailable" in body["error"]["message"], (name, body)
        else:
            assert body["error"]["code"] == "unavailable", (name, body)


def normal_again(calls: dict[str, Callable[[], httpx.Response]], since: str) -> None:
    """Every endpoint answers normally again within 30 s of `since` (which has just happened)."""
    began = time.monotonic()
    wait_until(
        lambda: statuses(probe(calls)) == UP, timeout=30, interval=0.5, what=f"every endpoint normal after {since}"
    )
    print(f"every endpoint normal {time.monotonic() - began:.1f}s after {since}")


def start_task(base: str, persona: Persona) -> str:
    created = httpx.post(
        f"{base}/runtime/tasks",
        json={"agent": "noop", "input": {"steps": 1}},
        headers={"Authorization": f"Bearer {persona.token}"},
        timeout=30,
    )
    assert created.status_code == 201, created.text
    return created.json()["taskId"]


def test_right_after_postgresql_ends_every_connection_each_endpoint_answers_normally(alice, processes: Processes):
    port = free_port()
    web = processes.web(port)
    base = f"http://127.0.0.1:{port}"
    calls = requests(base, alice, start_task(base, alice), session_for(alice))
    for _ in range(2):  # in parallel: the pool holds several connections, all about to die
        assert statuses(probe(calls)) == UP
    with connection.cursor() as cursor:  # every backend of the test database but ours: the web process's
        cursor.execute(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )
        assert cursor.fetchone()[0] >= 2
    assert statuses(probe(calls)) == UP  # not one dead connection handed out
    assert web.poll() is None


class PrivatePostgres:
    """A PostgreSQL cluster of our own (initdb in a temporary folder, run as the postgres
    user on a free port), so stopping it disturbs nobody."""

    def __init__(self) -> None:
        self.bin = Path(
            subprocess.run(["pg_config", "--bindir"], capture_output=True, text=True, check=True).stdout.strip()
        )
        self.as_postgres = [] if getpass.getuser() == "postgres" else ["runuser", "-u", "postgres", "--"]
        self.home = Path(tempfile.mkdtemp(prefix="runtime-pg-"))  # not under pytest's tmp: postgres must reach it
        shutil.chown(self.home, "postgres")
        self.data, self.port = self.home / "data", free_port()
        subprocess.run(
            [*self.as_postgres, self.bin / "initdb", "-D", self.data, "-U", "postgres", "-A", "trust", "--no-sync"],
            check=True,
            capture_output=True,
        )

    def _pg_ctl(self, *args: Any) -> None:
        subprocess.run(
            [*self.as_postgres, self.bin / "pg_ctl", "-D", self.data, "-l", self.home / "log", "-w", "-t", "60", *args],
            check=True,
            capture_output=True,
        )

    def start(self) -> None:
        self._pg_ctl("-o", f"-p {self.port} -k {self.home} -c listen_addresses=127.0.0.1 -c fsync=off", "start")

    def stop(self, mode: str = "fast") -> None:
        self._pg_ctl("-m", mode, "stop")  # fast: as a restart does, every session told, then closed

    def processes(self) -> list[int]:
        """The postmaster, then every process it started (backends, checkpointer, walwriter ...)."""
        postmaster = int((self.data / "postmaster.pid").read_text().split()[0])
        children = subprocess.run(
            ["pgrep", "-P", str(postmaster)],
            check=False,  # no children: exit status 1
            capture_output=True,
            text=True,
        ).stdout.split()
        return [postmaster, *map(int, children)]

    def freeze(self) -> None:
        """SIGSTOP the whole cluster: its sockets stay open and the kernel still accepts and
        acknowledges on its behalf, but nothing answers (a hung host, a partition that drops packets)."""
        os.kill(self.processes()[0], signal.SIGSTOP)  # first: a stopped postmaster starts no more backends
        for pid in self.processes()[1:]:
            os.kill(pid, signal.SIGSTOP)

    def thaw(self) -> None:
        for pid in reversed(self.processes()):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)

    def copy_of_the_test_database(self) -> str:
        """The test database as it is now, copied here; its DATABASE_URL."""
        name = connection.settings_dict["NAME"]
        target = ["-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres"]
        subprocess.run([self.bin / "createdb", *target, name], check=True, capture_output=True)
        dump = subprocess.run([self.bin / "pg_dump", "--no-owner", database_url()], check=True, capture_output=True)
        subprocess.run(
            [self.bin / "psql", *target, "-q", "-v", "ON_ERROR_STOP=1", "-d", name],
            input=dump.stdout,
            check=True,
            capture_output=True,
        )
        return f"postgres://postgres@127.0.0.1:{self.port}/{name}"


@pytest.fixture
def private_postgres() -> Iterator[PrivatePostgres]:
    cluster = PrivatePostgres()
    cluster.start()
    try:
        yield cluster
    finally:
        with contextlib.suppress(OSError):  # not running, or not frozen
            cluster.thaw()  # a frozen postmaster would not hear the stop
        with contextlib.suppress(subprocess.CalledProcessError):  # already stopped
            cluster.stop("immediate")
        shutil.rmtree(cluster.home, ignore_errors=True)


def test_while_the_database_is_down_every_endpoint_is_a_503_and_after_it_normal_again(
    alice, processes, private_postgres
):
    session = session_for(alice)  # before the copy, which carries alice, her key and her session
    port = free_port()
    web = processes.web(port, DATABASE_URL=private_postgres.copy_of_the_test_database())
    base = f"http://127.0.0.1:{port}"
    calls = requests(base, alice, start_task(base, alice), session)
    assert statuses(probe(calls)) == UP

    private_postgres.stop()
    assert_unavailable(probe(calls))
    assert_unavailable(probe(calls))  # and again: nothing was left broken by the first round

    private_postgres.start()
    normal_again(calls, "the database was back")
    assert web.poll() is None


def test_while_the_database_is_frozen_every_endpoint_is_a_503_within_the_deadline_and_after_it_normal_again(
    alice, processes, private_postgres
):
    """A frozen server fails nothing by itself: the kernel still acknowledges, so no timeout of
    the server's or of TCP's fires, and each request that reached the database waited for as
    long as the freeze lasted, holding its pooled connection (then every request, once they
    were all held). Each round trip now has a deadline (RUNTIME_DB_QUERY_SECONDS): a request is
    a 503 within it, or within the pool's timeout if no connection is free (RUNTIME_DB_POOL_TIMEOUT)."""
    deadline, pool_timeout = 3, 3
    bound = deadline + pool_timeout + 4  # the two waits, and a busy two-core machine's slack
    session = session_for(alice)
    port, url = free_port(), private_postgres.copy_of_the_test_database()
    web = processes.web(
        port,
        DATABASE_URL=url,
        RUNTIME_DB_QUERY_SECONDS=str(deadline),
        RUNTIME_DB_POOL_TIMEOUT=str(pool_timeout),
        RUNTIME_DB_POOL_MAX="6",  # fewer than the requests at once: every connection is caught in the freeze
    )
    base = f"http://127.0.0.1:{port}"
    # The client gives up well before the freeze ends: an answer that waits for the thaw fails the test.
    calls = requests(base, alice, start_task(base, alice), session, timeout=bound + 10)
    assert statuses(probe(calls)) == UP

    private_postgres.freeze()
    try:
        for round_no in range(2):  # the first round finds pooled connections to wait on, the second none
            with ThreadPoolExecutor(max_workers=1) as runner:
                round_ = runner.submit(probe, calls)
                healthz = 0
                while not round_.done():  # the process itself answers meanwhile, at once
                    alive = httpx.get(f"{base}/healthz", timeout=2)
                    assert alive.status_code == 200 and alive.elapsed.total_seconds() < 1, alive.elapsed
                    healthz += 1
                    wait([round_], timeout=0.2)
                answers = round_.result()
            assert healthz >= 3, healthz
            assert_unavailable(answers)
            took = {name: round(r.elapsed.total_seconds(), 1) for name, r in answers.items() if name != "healthz"}
            print(f"frozen, round {round_no}: 503s after {took}")
            assert max(took.values()) < bound, took
            ready = httpx.get(f"{base}/readyz", timeout=bound)  # its own connection: refused as promptly
            assert ready.status_code == 503 and ready.json()["checks"]["database"].startswith("unreachable"), ready.text
    finally:
        private_postgres.thaw()

    normal_again(calls, "the thaw")
    for _ in range(3):  # and it stays so: no pooled connection was left broken or held
        assert statuses(probe(calls)) == UP

    def sessions() -> int:  # the web process's, on the server: its two pools at most (6 + 4)
        with psycopg.connect(url, connect_timeout=5) as conn:
            query = (
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )
            return conn.execute(query).fetchone()[0]

    wait_until(lambda: sessions() <= 10, timeout=10, what=lambda: f"at most 10 sessions, not {sessions()}")
    assert web.poll() is None


def test_database_outages_longer_than_a_lease_are_infrastructure_faults_not_recoveries(
    alice, processes, private_postgres
):
    """While the server is down no worker can renew its lease, so every running task's lease
    expires; once it is back the reaper used to count that as a crashed worker, and with
    max_recoveries=1 the second outage dead-lettered a healthy task."""
    from conftest import FAST_LEASES
    from tasks_app.access import console
    from tasks_app.actions import do_create_task

    task, _ = do_create_task(console(alice.tenant, "user:test"), agent="noop", input={"steps": 30, "sleepMs": 300})
    url = private_postgres.copy_of_the_test_database()
    env = {**FAST_LEASES, "RUNTIME_MAX_RECOVERIES": "1", "DATABASE_URL": url}
    processes.worker(**env)
    processes.beat(**env)

    def row() -> dict[str, Any] | None:
        try:
            with psycopg.connect(url, connect_timeout=2, row_factory=dict_row) as conn:
                return conn.execute(
                    "SELECT status, steps_done, recoveries, infra_faults, lease_expires_at, error "
                    "FROM tasks_app_task WHERE id = %s",
                    [task.id],
                ).fetchone()
        except psycopg.OperationalError:
            return None

    for outage in range(2):
        done = row()["steps_done"]
        wait_until(
            lambda done=done: (r := row())["steps_done"] > done + 1 and r["lease_expires_at"],
            timeout=60,
            what=f"steps under a lease before outage {outage}",
        )
        expires = row()["lease_expires_at"].timestamp()
        private_postgres.stop()
        # down until the worker's lease has expired (one database clock: this machine's)
        wait_until(lambda expires=expires: time.time() > expires + 1, timeout=30, what="the lease to expire")
        private_postgres.start()
    wait_until(
        lambda: (r := row()) and r["status"] in ("completed", "failed", "dead_lettered"),
        timeout=120,
        what="the task to end",
    )
    final = row()
    assert final["status"] == "completed", final
    # (the worker's retry may claim the expired lease before the reaper sees it: then nothing is counted)
    assert final["recoveries"] == 0 and final["error"] is None, final


def counts(url: str, task_id: Any) -> dict[str, Any]:
    """The task's status, steps and fault counts, read from the private cluster at `url`."""
    with psycopg.connect(url, row_factory=dict_row) as conn:
        return conn.execute(
            "SELECT status, steps_done, recoveries, infra_faults, error FROM tasks_app_task WHERE id = %s",
            [task_id],
        ).fetchone()


def test_a_worker_mid_slice_gives_a_frozen_database_up_within_its_deadline_and_the_task_completes_after_the_thaw(
    alice, processes, private_postgres
):
    """A frozen server held a worker's slice (and its heartbeat) for as long as it was frozen:
    its connections, Django's own, had no deadline. Now a round trip waits at most
    RUNTIME_DB_WORKER_QUERY_SECONDS: the slice is abandoned as an infrastructure fault while the
    database is still frozen, and after the thaw the task goes on from its last step and
    completes, each step once, neither failed nor held for an operator."""
    from conftest import FAST_LEASES
    from tasks_app.access import console
    from tasks_app.actions import do_create_task

    deadline, steps = 2, 40
    task, _ = do_create_task(
        console(alice.tenant, "user:test"),
        agent="noop",
        input={"steps": steps, "sleepMs": 200},
        checkpoint_policy={"everySteps": 1},  # resumed from its last step: none runs twice by design
    )
    # connect_timeout: a reconnection to the frozen server (to give the lease back, the next claim) fails in 2 s
    url = private_postgres.copy_of_the_test_database() + "?connect_timeout=2"
    env = {**FAST_LEASES, "DATABASE_URL": url, "RUNTIME_DB_WORKER_QUERY_SECONDS": str(deadline)}
    worker = processes.worker(**env)
    processes.beat(**env)
    log = Path(worker.log_path)

    def row() -> dict[str, Any]:
        return counts(url, task.id)

    wait_until(lambda: row()["steps_done"] >= 3, timeout=60, what="steps under way")
    private_postgres.freeze()
    frozen_at = time.monotonic()
    try:
        # Within the deadline and a busy two-core machine's slack, while still frozen ...
        wait_until(
            lambda: "infrastructure fault" in log.read_text(errors="replace"),
            timeout=deadline + 10,
            what="the worker to give the frozen database up",
        )
        print(f"slice given up {time.monotonic() - frozen_at:.1f}s into the freeze")
        # ... and frozen on past the lease (3 s), which expires: giving it back cannot reach the database either.
        wait_until(
            lambda: "could not give the lease back" in log.read_text(errors="replace"),
            timeout=deadline + 2 + 10,
            what="the lease left to expire",
        )
        print(f"thawed {time.monotonic() - frozen_at:.1f}s into the freeze")
    finally:
        private_postgres.thaw()

    wait_until(lambda: row()["status"] not in ("queued", "working", "recovering"), timeout=120, what="the task to end")
    final = row()
    print(f"after the thaw: {final}")
    assert final["status"] == "completed" and final["error"] is None, final
    with psycopg.connect(url) as conn:
        ran = conn.execute(
            "SELECT sequence, attempt FROM tasks_app_step WHERE task_id = %s ORDER BY sequence", [task.id]
        ).fetchall()
    assert ran == [(sequence, 1) for sequence in range(1, steps + 1)], ran
    # The lease expired while the database was frozen. If the reaper sees it before the
    # worker's retry gives it back (operators.do_give_back), it counts a recovery (a freeze, unlike a restart, leaves the
    # database no trace to tell it from a lost worker): one of max_recoveries in a row
    # without progress, which the next step resets. Never more than one for one freeze.
    assert final["recoveries"] <= 1, final
    assert worker.poll() is None
    for line in log.read_text(errors="replace").splitlines():
        if "fault" in line or "lease back" in line:
            print(line[:300])


def test_a_lease_a_worker_could_not_give_back_in_a_database_blip_is_an_infrastructure_fault_not_a_lost_worker(
    alice, processes, private_postgres
):
    """A blip shorter than the lease: the frozen database cut a worker's slice (its deadline)
    and then its give-back, so the lease stayed with the worker, which runs the slice no more.
    Its retry, a second later, found the lease held and was dropped; the task sat until the
    lease ran out, and the reaper counted a lost worker: every blip that cut a give-back cost
    a recovery (four in a row dead-lettered a healthy task) and a whole lease of waiting. The
    retry carries the lease it must give back, and does, counted as the infrastructure fault."""
    from tasks_app.access import console
    from tasks_app.actions import do_create_task

    lease = 20
    task, _ = do_create_task(
        console(alice.tenant, "user:test"),
        agent="noop",
        input={"steps": 30, "sleepMs": 200},
        checkpoint_policy={"everySteps": 1},
    )
    url = private_postgres.copy_of_the_test_database() + "?connect_timeout=2"
    env = {
        "RUNTIME_LEASE_SECONDS": str(lease),
        "RUNTIME_HEARTBEAT_SECONDS": "1",
        "RUNTIME_SCAN_SECONDS": "1",
        "DATABASE_URL": url,
        "RUNTIME_DB_WORKER_QUERY_SECONDS": "2",
    }
    worker = processes.worker(**env)
    processes.beat(**env)
    log = Path(worker.log_path)

    def row() -> dict[str, Any]:
        return counts(url, task.id)

    wait_until(lambda: row()["steps_done"] >= 3, timeout=60, what="steps under way")
    private_postgres.freeze()
    try:
        wait_until(
            lambda: "could not give the lease back" in log.read_text(errors="replace"),
            timeout=30,
            what="the worker to give the frozen database up, and fail to give its lease back",
        )
    finally:
        private_postgres.thaw()
    thawed = time.monotonic()
    wait_until(lambda: row()["status"] not in ("queued", "working", "recovering"), timeout=120, what="the task to end")
    final = row()
    assert final["status"] == "completed" and final["error"] is None, final
    assert final["recoveries"] == 0 and final["infra_faults"] >= 1, final
    # Given back by the retry, not left to run out: done well within a lease of the thaw.
    assert time.monotonic() - thawed < lease, final
    assert worker.poll() is None


def test_readyz_is_a_503_within_its_deadline_when_the_database_freezes_after_it_connected(processes, private_postgres):
    """/readyz checks the database through a connection of its own: its connect timeout bounded
    a server frozen before it connected, and the server's statement_timeout a slow statement,
    but a server that froze after it connected (its timers stopped with it) held the probe for
    as long as it was frozen. Frozen here at the moment the probe's statement waits on the
    server (for a lock the test holds): the probe's own round trips now have a deadline."""
    from runtime_site.health import MIGRATIONS, TIMEOUT

    url = private_postgres.copy_of_the_test_database()
    port = free_port()
    processes.web(port, DATABASE_URL=url)
    base = f"http://127.0.0.1:{port}"
    assert httpx.get(f"{base}/readyz", timeout=30).status_code == 200
    bound = TIMEOUT + 4  # the deadline, and a busy two-core machine's slack

    with psycopg.connect(url) as locker, psycopg.connect(url, autocommit=True) as watcher:
        locker.execute("LOCK TABLE django_migrations IN ACCESS EXCLUSIVE MODE")  # held until the rollback below
        with ThreadPoolExecutor(max_workers=1) as runner:
            started = time.monotonic()
            ready = runner.submit(httpx.get, f"{base}/readyz", timeout=60)

            def probe_waits() -> bool:
                return bool(
                    watcher.execute(
                        "SELECT 1 FROM pg_stat_activity WHERE query = %s AND wait_event_type = 'Lock'", [MIGRATIONS]
                    ).fetchone()
                )

            wait_until(probe_waits, timeout=TIMEOUT, interval=0.02, what="the probe's statement at the server")
            private_postgres.freeze()  # before its statement_timeout: the server's timer stops with it
            try:
                wait([ready], timeout=bound - (time.monotonic() - started))
                assert ready.done(), f"/readyz still waiting {time.monotonic() - started:.1f}s into the freeze"
            finally:
                private_postgres.thaw()
            answer = ready.result()
        locker.rollback()
    print(f"/readyz answered {answer.status_code} after {answer.elapsed.total_seconds():.1f}s: {answer.text}")
    assert answer.status_code == 503, answer.text
    assert answer.json()["checks"]["database"].startswith("unreachable: "), answer.text
    assert answer.elapsed.total_seconds() < bound
    wait_until(
        lambda: httpx.get(f"{base}/readyz", timeout=30).status_code == 200, timeout=30, what="/readyz ready again"
    )


def test_while_the_database_has_no_connection_slot_free_every_endpoint_is_a_503_that_says_so(alice, processes):
    """max_connections reached (53300): the server refuses each new connection, and the web's
    pools, connecting in threads of their own, told a request only that none was free in time,
    as if it were merely busy. The 503 names the refusal, and once a slot is free, normal again.

    A login role's CONNECTION LIMIT is refused with the same SQLSTATE, as the shared server's
    max_connections would be, without filling a server others use (superusers are exempt:
    the web connects as a role of its own)."""
    session = session_for(alice)
    role = f"web_{uuid.uuid4().hex[:12]}"
    with connection.cursor() as cursor:
        cursor.execute(f"CREATE ROLE {role} LOGIN")
        cursor.execute(f"GRANT USAGE ON SCHEMA public TO {role}")
        cursor.execute(f"GRANT ALL ON ALL TABLES IN SCHEMA public TO {role}")
        cursor.execute(f"GRANT ALL ON ALL SEQUENCES IN SCHEMA public TO {role}")
    try:
        port = free_port()
        url = database_url().replace("postgres://postgres@", f"postgres://{role}@", 1)
        assert role in url
        web = processes.web(port, DATABASE_URL=url, RUNTIME_DB_POOL_TIMEOUT="2")
        base = f"http://127.0.0.1:{port}"
        calls = requests(base, alice, start_task(base, alice), session)
        assert statuses(probe(calls)) == UP

        with connection.cursor() as cursor:  # no slot for it, and its sessions ended: each new one is refused
            cursor.execute(f"ALTER ROLE {role} CONNECTION LIMIT 0")
            cursor.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s", [role])
        answers = probe(calls)
        assert_unavailable(answers)
        for name, response in answers.items():
            if name != "healthz":
                assert "no connection slot free" in response.text, (name, response.text)

        with connection.cursor() as cursor:
            cursor.execute(f"ALTER ROLE {role} CONNECTION LIMIT -1")
        normal_again(calls, "a slot was free")
        assert web.poll() is None
    finally:
        processes.stop_all()
        with connection.cursor() as cursor:
            cursor.execute(f"DROP OWNED BY {role}")
            cursor.execute(f"DROP ROLE {role}")


def test_a_database_gone_read_only_for_a_while_is_an_infrastructure_fault_not_a_lost_worker_nor_a_500(
    alice, processes, private_postgres
):
    """A server that takes no writes for a while (default_transaction_read_only, as a
    failover's standby not yet promoted or an operator's maintenance sets it) refuses each
    write with SQLSTATE 25006, which was none of the faults: the worker's slice raised it as
    a bug (its claim's SELECT ... FOR NO KEY UPDATE refused), neither retried after a backoff
    nor counted as an infrastructure fault, and the API answered a write with a 500. It is the
    database's fault of the moment: the worker abandons the slice and retries after a
    backoff, counted as an infrastructure fault, the API answers 503 with Retry-After, and
    once the server takes writes again the task completes, each step once."""
    from tasks_app.access import console
    from tasks_app.actions import do_create_task

    steps, lease = 30, 20
    task, _ = do_create_task(
        console(alice.tenant, "user:test"),
        agent="noop",
        input={"steps": steps, "sleepMs": 200},
        checkpoint_policy={"everySteps": 1},
    )
    url = private_postgres.copy_of_the_test_database()
    env = {
        "RUNTIME_LEASE_SECONDS": str(lease),  # the read-only while is shorter: no lease runs out in it
        "RUNTIME_HEARTBEAT_SECONDS": "1",
        "RUNTIME_SCAN_SECONDS": "1",
        "DATABASE_URL": url,
    }
    worker = processes.worker(**env)
    processes.beat(**env)
    port = free_port()
    web = processes.web(port, DATABASE_URL=url)
    log = Path(worker.log_path)

    def create() -> httpx.Response:
        return httpx.post(
            f"http://127.0.0.1:{port}/runtime/tasks",
            json={"agent": "noop", "input": {"steps": 1}},
            headers={"Authorization": f"Bearer {alice.token}"},
            timeout=30,
        )

    def read_only(on: bool) -> None:
        with psycopg.connect(url, autocommit=True) as conn:  # ALTER SYSTEM runs outside a transaction
            if on:
                conn.execute("ALTER SYSTEM SET default_transaction_read_only = on")
            else:
                conn.execute("ALTER SYSTEM RESET default_transaction_read_only")
            conn.execute("SELECT pg_reload_conf()")  # every session takes it at its next statement

    def row() -> dict[str, Any]:
        return counts(url, task.id)  # a read: answered while read-only too

    assert create().status_code == 201
    wait_until(lambda: row()["steps_done"] >= 3, timeout=60, what="steps under way")
    read_only(True)
    try:
        # Until the reload reaches the web's sessions a create may still be written (201), never a 500.
        refused = wait_until(
            lambda: (answer := create()).status_code != 201 and answer, timeout=30, what="a create refused"
        )
        assert refused.status_code == 503, refused.text
        assert int(refused.headers["Retry-After"]) > 0
        assert refused.json()["error"]["code"] == "unavailable", refused.text
        assert "read-only" in refused.json()["error"]["message"], refused.text
        wait_until(
            lambda: "infrastructure fault" in log.read_text(errors="replace"),
            timeout=30,
            what="the worker to meet the read-only database",
        )
        assert row()["status"] == "working", row()  # delayed, not failed
    finally:
        read_only(False)
    wait_until(lambda: row()["status"] not in ("queued", "working", "recovering"), timeout=120, what="the task to end")
    final = row()
    assert final["status"] == "completed" and final["error"] is None, final
    assert final["recoveries"] == 0 and final["infra_faults"] >= 1, final
    with psycopg.connect(url) as conn:
        ran = conn.execute(
            "SELECT sequence, attempt FROM tasks_app_step WHERE task_id = %s ORDER BY sequence", [task.id]
        ).fetchall()
    assert ran == [(sequence, 1) for sequence in range(1, steps + 1)], ran
    assert create().status_code == 201
    assert worker.poll() is None and web.poll() is None
