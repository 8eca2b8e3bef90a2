"""rt — submit, list, watch, steer and approve tasks from a terminal.

    export RT_URL=http://127.0.0.1:8000 RT_API_KEY=rt_...   (bin/run prints a key)
    rt submit --input '{"corpus": "corpora/demo", "limit": 200}' --watch
    rt list
    rt watch <task>            live progress bar and phase, ends with the result
    rt steer <task> pause      also resume, cancel, adjust_goal --goal ..., set_priority --priority N,
                               kill --reason ... (emergency stop: does not wait for the running step)
    rt approve <task> [<key>]  answer the open approval (--reject to refuse)
    rt artifact <task> [<name>] [-o FILE]   list a task's artifacts, or fetch one (stdout or FILE)

Exit codes: 0 done (watch: completed), 1 the task failed or was cancelled, 2 usage or
HTTP error, 3 someone changed the task first (stale version: 409).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import uuid
from typing import Any, TextIO

import httpx

from rtcli.client import ApiError, BadAnswer, BadInput, Client

BAR = 30


def _json(text: str, what: str) -> Any:
    """`text` as JSON the API can take, or exit 2 saying why: Python's parser also reads NaN
    and Infinity, and keeps lone surrogates, neither of which the request could send."""
    try:
        value = json.loads(text, parse_constant=_not_a_number)
        json.dumps(
            value, ensure_ascii=False, allow_nan=False
        ).encode()  # the bytes the request would carry (1e400: inf)
    except UnicodeEncodeError as exc:
        print(f"rt: {what} has a lone surrogate ({exc.object[exc.start : exc.end]!r}), not Unicode", file=sys.stderr)
        raise SystemExit(2) from None
    except ValueError as exc:
        print(f"rt: {what} is not JSON: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    return value


def _not_a_number(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


class Progress:
    """A progress bar on a terminal; a line per visible change otherwise (logs, tests)."""

    def __init__(self, out: TextIO, tty: bool) -> None:
        self.out, self.tty, self.shown = out, tty, ("", -1, "", "")

    def update(self, status: str, progress: float, phase: str, message: str) -> None:
        percent = round((progress or 0) * 100)
        if (status, percent, phase, message) == self.shown:
            return
        self.shown = (status, percent, phase, message)
        filled = int(BAR * percent / 100)
        bar = "█" * filled + "░" * (BAR - filled)
        text = f"[{bar}] {percent:3d}%  {status:<14} {phase or '-':<20} {message}"
        if self.tty:
            self.out.write("\r\x1b[2K" + text[:200])
        else:
            self.out.write(text.rstrip() + "\n")
        self.out.flush()

    def say(self, text: str) -> None:
        if self.tty:
            self.out.write("\r\x1b[2K")
        self.out.write(text + "\n")
        self.out.flush()
        self.shown = ("", -1, "", "")


def watch(client: Client, task_id: str, out: TextIO = sys.stdout, tty: bool | None = None) -> int:
    bar = Progress(out, out.isatty() if tty is None else tty)
    state: dict[str, Any] = {"status": "", "progress": 0.0, "phase": "", "message": ""}
    for event in client.events(task_id):
        data = event.data
        if event.type == "task.snapshot":
            state.update(
                status=data["runtimeStatus"],
                progress=data["progress"],
                phase=data["phase"],
                message=data["statusMessage"],
            )
            for request in data.get("inputRequests", []):
                bar.say(
                    f"waiting for input {request['key']}: {request['prompt']}\n"
                    f"  answer with: rt approve {task_id} {request['key']}   (or --reject)"
                )
        elif event.type == "progress":
            state.update(
                progress=data["progress"], phase=data.get("phase") or state["phase"], message=data.get("message") or ""
            )
        elif event.type == "log":
            bar.say(f"  log #{data.get('step')}: {data.get('message')}")
        elif event.type == "checkpoint":
            bar.say(f"  checkpoint #{data['checkpoint']} ({data['reason']})")
        elif event.type in ("steering.applied", "steering.rejected"):
            state["status"] = data["runtimeStatus"]
            verb = "applied" if event.type == "steering.applied" else f"rejected ({data['outcome']})"
            bar.say(f"  {data['type']} {verb}; task is {data['runtimeStatus']} (version {data['stateVersion']})")
        elif event.type == "input_required":
            state["status"] = "input_required"
            bar.say(
                f"waiting for input {data['key']}: {data['prompt']}\n"
                f"  answer with: rt approve {task_id} {data['key']}   (or --reject)"
            )
        elif event.type == "recovering":
            state["status"] = "recovering"
            bar.say(f"  recovering: {data['reason']}")
        elif event.type == "dead_lettered":
            state["status"] = "dead_lettered"
            bar.say(f"  held for an operator: {data['reason']}")
        elif event.type == "terminal":
            state["status"] = data["runtimeStatus"]
        bar.update(state["status"], state["progress"], state["phase"], state["message"])
    result = client.result(task_id)
    bar.say(f"{result['runtimeStatus']}: task {task_id}")
    if result.get("error"):
        bar.say(f"error: {json.dumps(result['error'])}")
    outcome = result.get("result")
    if isinstance(outcome, dict):
        if (outcome.get("report") or {}).get("markdown"):
            bar.say(f"report: {outcome['report']['markdown']}")
        if (outcome.get("published") or {}).get("ref"):
            bar.say(f"published: {outcome['published']['ref']}")
    if outcome is not None:
        bar.say("result: " + json.dumps(outcome))
    return 0 if result["runtimeStatus"] == "completed" else 1


def _print_tasks(tasks: list[dict[str, Any]], out: TextIO) -> None:
    out.write(f"{'task':<36}  {'status':<14} {'progress':>8}  {'phase':<20} agent\n")
    for t in tasks:
        out.write(
            f"{t['taskId']:<36}  {t['runtimeStatus']:<14} {round(t['progress'] * 100):>7}%  "
            f"{t['phase'] or '-':<20} {t['agent']}\n"
        )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rt", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--url", default=os.getenv("RT_URL", "http://127.0.0.1:8000"), help="runtime base URL ($RT_URL)"
    )
    parser.add_argument("--api-key", default=os.getenv("RT_API_KEY"), help="bearer API key ($RT_API_KEY)")
    sub = parser.add_subparsers(dest="command", required=True)

    submit = sub.add_parser("submit", help="start a task; prints its id")
    submit.add_argument("--agent", default="document_review")
    submit.add_argument("--input", default='{"corpus": "corpora/demo"}', help="the agent's input as JSON")
    submit.add_argument("--goal", default="")
    submit.add_argument("--priority", type=int, default=5, choices=range(10), metavar="0-9")
    submit.add_argument("--idempotency-key", help="the same key and body again returns the same task")
    submit.add_argument("--watch", action="store_true", help="then watch it to the end")

    listing = sub.add_parser("list", help="your tenant's tasks, newest first")
    listing.add_argument("--status")
    listing.add_argument("--limit", type=int, default=20)

    show = sub.add_parser("show", help="a task's snapshot as JSON")
    show.add_argument("task")

    watch_ = sub.add_parser("watch", help="live progress over SSE until the task ends")
    watch_.add_argument("task")
    watch_.add_argument("--plain", action="store_true", help="a line per change, no bar (default when piped)")

    steer = sub.add_parser("steer", help="pause, resume, cancel, adjust_goal, set_priority, kill")
    steer.add_argument("task")
    steer.add_argument("type", choices=["pause", "resume", "cancel", "adjust_goal", "set_priority", "kill"])
    steer.add_argument("--goal")
    steer.add_argument("--constraints", help="adjust_goal constraints as JSON, e.g. '{\"excludeExpired\": true}'")
    steer.add_argument("--priority", type=int, choices=range(10), metavar="0-9")
    steer.add_argument("--reason", default="")
    steer.add_argument(
        "--expected-version",
        type=int,
        help="the version you decided on (default: the task's current version, read first)",
    )

    approve = sub.add_parser("approve", help="answer an open approval (the only one, or KEY)")
    approve.add_argument("task")
    approve.add_argument("key", nargs="?")
    approve.add_argument("--reject", action="store_true")
    approve.add_argument("--reason", default="")

    artifact = sub.add_parser("artifact", help="list a task's artifacts, or fetch one (to stdout or -o FILE)")
    artifact.add_argument("task")
    artifact.add_argument("name", nargs="?")
    artifact.add_argument("-o", "--output", help="write it to this file instead of stdout")
    return parser


def main(argv: list[str] | None = None, out: TextIO = sys.stdout) -> int:
    args = build_parser().parse_args(argv)
    if not args.api_key:
        print("rt: an API key is needed: --api-key or $RT_API_KEY (bin/run prints one)", file=sys.stderr)
        return 2
    try:
        return _run(Client(args.url, args.api_key), args, out)
    except ApiError as exc:
        if exc.status == 409 and exc.code == "version_conflict":
            snap = exc.body["error"].get("snapshot")
            try:
                now = (
                    f" It is now {snap['runtimeStatus']} at version {snap['stateVersion']} "
                    f"({round(snap['progress'] * 100)}%, phase {snap['phase'] or '-'})."
                )
            except (KeyError, TypeError):
                now = ""
            print(f"rt: someone changed this task first; nothing was changed.{now}", file=sys.stderr)
            return 3
        print(f"rt: {exc}", file=sys.stderr)
        return 2
    except BadInput as exc:
        print(f"rt: {exc}", file=sys.stderr)
        return 2
    except httpx.TransportError as exc:
        print(f"rt: cannot reach {args.url}: {exc or type(exc).__name__}", file=sys.stderr)
        return 2
    except (httpx.HTTPError, httpx.InvalidURL) as exc:  # a redirect loop, a body that does not decode, ...
        print(f"rt: {args.url}: {exc or type(exc).__name__}", file=sys.stderr)
        return 2
    except BadAnswer as exc:
        print(f"rt: unexpected answer from {args.url}: {exc}", file=sys.stderr)
        return 2
    except (KeyError, TypeError, AttributeError) as exc:
        # The answers are read by the fields the API documents; one without them (another
        # service, a proxy, a server of another version) is the server's problem to report,
        # not a traceback.
        print(f"rt: unexpected answer from {args.url}: it lacks what the API sends ({exc!r})", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _run(client: Client, args: argparse.Namespace, out: TextIO) -> int:
    match args.command:
        case "submit":
            created = client.submit(
                args.agent,
                _json(args.input, "--input"),
                goal=args.goal,
                priority=args.priority,
                idempotency_key=args.idempotency_key,
            )
            out.write(created["taskId"] + "\n")
            out.flush()
            return watch(client, created["taskId"], out) if args.watch else 0
        case "list":
            _print_tasks(client.tasks(status=args.status, limit=args.limit), out)
        case "show":
            out.write(json.dumps(client.snapshot(args.task), indent=2) + "\n")
        case "watch":
            return watch(client, args.task, out, tty=False if args.plain else None)
        case "steer":
            payload: dict[str, Any] = {}
            if args.type == "adjust_goal":
                if args.goal:
                    payload["goal"] = args.goal
                if args.constraints:
                    payload["constraints"] = _json(args.constraints, "--constraints")
            if args.type == "set_priority":
                if args.priority is None:
                    raise BadInput("set_priority needs --priority 0-9")
                payload["priority"] = args.priority
            version = args.expected_version or client.snapshot(args.task)["stateVersion"]
            command = client.steer(
                args.task,
                args.type,
                payload,
                expected_version=version,
                command_id=f"rt-{uuid.uuid4().hex[:16]}",
                reason=args.reason,
            )
            outcome = f": {command['outcome']}" if command.get("outcome") else ""
            out.write(f"{command['type']} accepted as version {command['version']} ({command['status']}){outcome}\n")
        case "approve":
            key = args.key
            if key is None:
                open_requests = client.snapshot(args.task)["inputRequests"]
                if len(open_requests) != 1:
                    keys = ", ".join(r["key"] for r in open_requests) or "none"
                    raise BadInput(f"name the input request to answer (open: {keys})")
                key = open_requests[0]["key"]
            answer = "reject" if args.reject else "approve"
            client.answer(args.task, key, answer, reason=args.reason)
            out.write(f"{key}: {answer} sent\n")
        case "artifact":
            if args.name is None:
                for item in client.artifacts(args.task):
                    out.write(f"{item['name']}\t{item['contentType']}\n")
                return 0
            data = client.artifact(args.task, args.name)
            if args.output:
                try:
                    with open(args.output, "wb") as f:
                        f.write(data)
                except OSError as exc:
                    raise BadInput(f"cannot write {args.output}: {exc.strerror or exc}") from None
            elif hasattr(out, "buffer"):
                out.flush()
                out.buffer.write(data)
            else:
                out.write(data.decode(errors="replace"))
    return 0
