# Shared by bin/run and bin/test: find Python 3.12+, make .venv, install the pinned set.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${RUNTIME_VENV:-$ROOT/.venv}"

find_python() {
  local candidates=()
  [ -n "${PYTHON:-}" ] && candidates+=("$PYTHON")
  command -v pyenv >/dev/null 2>&1 && for v in 3.12.1 3.13.0; do
    p="$(PYENV_VERSION=$v pyenv which python 2>/dev/null || true)"; [ -n "$p" ] && candidates+=("$p")
  done
  candidates+=(python3.13 python3.12 python3)
  for c in "${candidates[@]}"; do
    if command -v "$c" >/dev/null 2>&1 && "$c" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
      command -v "$c"; return 0
    fi
  done
  echo "error: Python 3.12 or newer is required (Django 6). Install it or set PYTHON=/path/to/python3.12" >&2
  return 1
}

ensure_venv() {
  if [ ! -x "$VENV/bin/python" ]; then
    local py; py="$(find_python)"
    echo "creating $VENV with $py" >&2
    "$py" -m venv "$VENV"
  fi
  local stamp="$VENV/.requirements.sha256" want
  want="$(sha256sum "$ROOT/requirements.txt" | cut -d' ' -f1)"
  if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    echo "installing requirements into $VENV" >&2
    # (grep drops pip's notes about local package mirrors that some machines configure)
    "$VENV/bin/python" -m pip install -q --upgrade pip 2>&1 | grep -v "^WARNING: Location" >&2 || true
    "$VENV/bin/python" -m pip install -q -r "$ROOT/requirements.txt" 2>&1 | grep -v "^WARNING: Location" >&2 || true
    "$VENV/bin/python" -c "import django, celery, rest_framework" || { echo "error: installing requirements failed" >&2; exit 1; }
    echo "$want" > "$stamp"
  fi
  export PATH="$VENV/bin:$PATH"
}
