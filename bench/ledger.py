"""What exactly-once costs per side effect: a tool call through the ledger vs the same call bare.

    .venv/bin/python bench/ledger.py --calls 300

In one process, against PostgreSQL and two local receivers started here (tests/sink.py
for HTTP, tests/mcp_remote.py for MCP, built with the official SDK): N `http.request`
calls through ledger_app.actions.execute_once (policy guard, started row, call, settled
row, each fenced on a real lease) beside N bare httpx requests to the same receiver; N
`mcp.call` calls through the ledger beside N bare SDK calls (ledger_app.mcp_client);
and N replays of already-settled keys (the answer a re-run step gets, no call). Prints
ms per call, p50/p99, and the ratios to the bare calls.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import _common


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1000


def receiver(module: str, logs: Path) -> tuple[object, str]:
    import httpx

    port = _common.free_port()
    proc = _common.start([module, "--port", str(port)], logs / f"{module}.log")
    url = f"http://127.0.0.1:{port}"
    _common.wait(lambda: _answers(httpx, f"{url}/stats"), timeout=30, interval=0.05)
    return proc, url


def _answers(httpx, url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def row(label: str, values: list[float], base: list[float] | None = None) -> str:
    mean = sum(values) / len(values)
    ratio = f"  ratio {mean / (sum(base) / len(base)):.2f}" if base else ""
    return (
        f"{label:<34} {mean:7.2f} ms/call  p50 {_common.percentile(values, 50):6.2f}"
        f"  p99 {_common.percentile(values, 99):6.2f}{ratio}"
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=300)
    args = parser.parse_args()
    _common.setup(SECURITY_HTTP_ALLOWLIST="127.0.0.1")
    import httpx

    from ledger_app import mcp_client
    from ledger_app.actions import execute_once
    from tasks_app import leases
    from tasks_app.access import console
    from tasks_app.actions import do_create_task
    from tasks_app.models import Tenant

    tenant = Tenant.objects.create(slug="bench", name="bench")
    logs = Path(tempfile.mkdtemp(prefix="bench-ledger-"))
    sink, sink_url = receiver("tests.sink", logs)
    remote, remote_url = receiver("tests.mcp_remote", logs)
    try:
        task, _ = do_create_task(console(tenant, "user:bench"), agent="noop", input={"steps": 1})
        lease = leases.claim(task.id, worker_id="bench", ttl=3600)
        assert lease is not None

        def through_ledger(sequence: int, name: str, call_args: dict) -> None:
            execute_once(lease, tenant_id=tenant.id, sequence=sequence, index=1, name=name, args=call_args, answers={})

        n = args.calls
        bare = httpx.Client()  # as the tool does: one pooled client
        bare_http = [
            timed(
                lambda i=i: bare.post(
                    f"{sink_url}/effects", json={"n": i}, headers={"Idempotency-Key": f"bare-{i}"}, timeout=10
                )
            )
            for i in range(n)
        ]
        ledger_http = [
            timed(lambda i=i: through_ledger(i + 1, "http.request", {"url": f"{sink_url}/effects", "json": {"n": i}}))
            for i in range(n)
        ]
        replays = [
            timed(lambda i=i: through_ledger(i + 1, "http.request", {"url": f"{sink_url}/effects", "json": {"n": i}}))
            for i in range(n)
        ]
        mcp = f"{remote_url}/mcp"
        bare_mcp = [
            timed(lambda i=i: mcp_client.call_tool(mcp, "record", {"text": str(i)}, key=f"bare-{i}", timeout=10))
            for i in range(n)
        ]
        ledger_mcp = [
            timed(
                lambda i=i: through_ledger(
                    n + i + 1, "mcp.call", {"server": mcp, "tool": "record", "arguments": {"text": str(i)}}
                )
            )
            for i in range(n)
        ]
        effects = httpx.get(f"{sink_url}/stats").json()["effects"]
        remote_effects = httpx.get(f"{remote_url}/stats").json()["effects"]["record"]
    finally:
        for proc in (sink, remote):
            proc.terminate()
            proc.wait()
    print(
        f"{n} calls each (receiver counted {effects} HTTP effects and {remote_effects} MCP effects; "
        f"expected {2 * n} each)"
    )
    print(row("http.request, bare httpx", bare_http))
    print(row("http.request, through the ledger", ledger_http, bare_http))
    print(row("replay of a settled key (no call)", replays))
    print(row("mcp.call, bare SDK call", bare_mcp))
    print(row("mcp.call, through the ledger", ledger_mcp, bare_mcp))
    if effects != 2 * n or remote_effects != 2 * n:
        sys.exit("an effect was lost or repeated")


if __name__ == "__main__":
    main()
