"""The tools a planner may offer its model: the built-in tools, the tools of the remote MCP
servers named in config (`tools.mcp_servers`, listed with tools/list and cached), and the
planner's own (update_plan, ask_person, finish); filtered by the task's `tools` and the
security allow and deny lists.

A catalog entry names the function the model sees (`[A-Za-z0-9_-]`: dots are not allowed
in function names) and what it maps to. It is built once per task and kept in the state,
so a step run again offers its model exactly the same tools."""

from __future__ import annotations

import fnmatch
import json
import logging
import re
import time
from typing import Any

from django.conf import settings

logger = logging.getLogger(__name__)

# Never offered to a model: its own wire, and the raw remote-call tool (remote tools are
# offered one by one, under their own names and schemas).
HIDDEN = {"llm.chat", "mcp.call"}
LIST_CACHE_SECONDS = 300.0
# A remote server decides what it lists: bounded, so that its list cannot crowd out the
# model's context or the checkpoint (the catalog is kept in the state).
MAX_REMOTE_TOOLS = 100  # per server
MAX_SCHEMA_CHARS = 20_000  # a tool whose input schema is larger is not offered
_listed: dict[str, tuple[float, list[dict[str, Any]]]] = {}

PLAN_STEP = {
    "type": "object",
    "properties": {
        "id": {"type": "string", "maxLength": 40},
        "title": {"type": "string", "minLength": 1, "maxLength": 300},
        "status": {"enum": ["todo", "doing", "done", "skipped"]},
    },
    "required": ["title", "status"],
}
OWN = [
    {
        "name": "update_plan",
        "kind": "plan",
        "description": "Replace the plan with these steps (with their status). Steps already done stay done.",
        "parameters": {
            "type": "object",
            "properties": {"steps": {"type": "array", "items": PLAN_STEP, "maxItems": 50}},
            "required": ["steps"],
            "additionalProperties": False,
        },
    },
    {
        "name": "ask_person",
        "kind": "ask",
        "description": "Ask a person a question only a person can answer; the task waits for the answer.",
        "parameters": {
            "type": "object",
            "properties": {"question": {"type": "string", "minLength": 1, "maxLength": 2000}},
            "required": ["question"],
            "additionalProperties": False,
        },
    },
    {
        "name": "finish",
        "kind": "finish",
        "description": "The goal is met: give the final answer.",
        "parameters": {
            "type": "object",
            "properties": {"answer": {"type": "string", "minLength": 1}},
            "required": ["answer"],
            "additionalProperties": False,
        },
    },
]


def _function_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_-]", "_", name)[:64]


def _allowed(qualified: str, wanted: list[str] | None) -> bool:
    security = settings.RUNTIME["security"]
    if qualified in security["deny_tools"]:
        return False
    if security["allow_tools"] and qualified not in security["allow_tools"]:
        return False
    return wanted is None or any(fnmatch.fnmatchcase(qualified, pattern) for pattern in wanted)


def _remote_tools(url: str, credential: str | None) -> list[dict[str, Any]]:
    """tools/list of one server, cached per process for LIST_CACHE_SECONDS."""
    from ledger_app import mcp_client, tools

    now = time.monotonic()
    if (hit := _listed.get(url)) and now - hit[0] < LIST_CACHE_SECONDS:
        return hit[1]
    headers = tools._credential_headers({"credential": credential} if credential else {})
    listed = mcp_client.list_tools(url, timeout=30.0, headers=headers)
    _listed[url] = (now, listed)
    return listed


def build(wanted: list[str] | None) -> tuple[list[dict[str, Any]], list[str]]:
    """(catalog, notes): notes say which servers could not be listed."""
    from tasks_app.agents import tools

    catalog: list[dict[str, Any]] = [dict(own) for own in OWN]
    for name in tools.tool_names():
        if name not in HIDDEN and _allowed(name, wanted):
            tool = tools.get_tool(name)
            catalog.append(
                {
                    "name": _function_name(name),
                    "kind": "tool",
                    "tool": name,
                    "description": f"The runtime's {name} tool.",
                    "parameters": tool.input_schema,
                }
            )
    notes = []
    for server, spec in sorted((settings.RUNTIME["tools"].get("mcp_servers") or {}).items()):
        try:
            listed = _remote_tools(spec["url"], spec.get("credential"))
        except Exception as exc:  # noqa: BLE001 (a remote that is down costs its tools, not the task)
            logger.warning("planner: cannot list the tools of %s: %s", server, exc)
            notes.append(f"The tools of MCP server {server!r} could not be listed: {exc}"[:300])
            continue
        offered = 0
        for remote in listed:
            qualified = f"{server}.{remote['name']}"
            if not _allowed(qualified, wanted):
                continue
            if offered >= MAX_REMOTE_TOOLS:
                notes.append(
                    f"MCP server {server!r} lists more than {MAX_REMOTE_TOOLS} tools; the rest are not offered"
                )
                break
            if len(json.dumps(remote.get("inputSchema") or {})) > MAX_SCHEMA_CHARS:
                notes.append(f"{qualified} is not offered: its input schema is over {MAX_SCHEMA_CHARS} characters")
                continue
            offered += 1
            catalog.append(
                {
                    "name": _function_name(f"{server}__{remote['name']}"),
                    "kind": "mcp",
                    "tool": qualified,
                    "server": spec["url"],
                    "remoteTool": remote["name"],
                    "credential": spec.get("credential"),
                    "description": (remote.get("description") or qualified)[:500],
                    "parameters": remote.get("inputSchema") or {"type": "object"},
                }
            )
    return _unique(catalog, notes), notes


def _unique(catalog: list[dict[str, Any]], notes: list[str]) -> list[dict[str, Any]]:
    """One entry per function name. Names are mangled (dots become underscores, cut at 64),
    so two tools can meet under one (server "a_" tool "b" and server "a" tool "_b"): the
    first keeps it, the other is not offered, rather than a call meant for one reaching the
    other."""
    seen: set[str] = set()
    kept = []
    for entry in catalog:
        if entry["name"] in seen:
            notes.append(f"{entry.get('tool', entry['name'])} is not offered: its name clashes as {entry['name']!r}")
            continue
        seen.add(entry["name"])
        kept.append(entry)
    return kept


def functions(catalog: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What the model is offered."""
    return [{"name": e["name"], "description": e["description"], "parameters": e["parameters"]} for e in catalog]


def ledger_call(entry: dict[str, Any], arguments: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The registered tool and arguments that carry out a call of `entry`."""
    if entry["kind"] == "mcp":
        args = {"server": entry["server"], "tool": entry["remoteTool"], "arguments": arguments}
        if entry.get("credential"):
            args["credential"] = entry["credential"]
        return "mcp.call", args
    return entry["tool"], arguments
