#!/usr/bin/env bash
# A separate virtual environment with the 1.x MCP SDK (the 2025-11-25 legacy task client):
# 1.x and 2.x cannot share one environment. Cached in .venv-mcp1; prints its python.
source "$(dirname "$0")/../bin/_env.sh"
PIN="mcp==1.30.0"
VENV1="${RUNTIME_MCP1_VENV:-$ROOT/.venv-mcp1}"
if [ ! -x "$VENV1/bin/python" ]; then
  py="$(find_python)"
  "$py" -m venv "$VENV1" >&2
fi
if [ "$(cat "$VENV1/.pin" 2>/dev/null)" != "$PIN" ]; then
  "$VENV1/bin/python" -m pip install -q "$PIN" 2>&1 | grep -v "^WARNING: Location" >&2 || true
  "$VENV1/bin/python" -c "import mcp.client.streamable_http" || { echo "error: installing $PIN failed" >&2; exit 1; }
  echo "$PIN" > "$VENV1/.pin"
fi
echo "$VENV1/bin/python"
