# Shared helpers of the launch scripts (sourced, not run). Bash 4+.
# Every process a script starts is stopped by its PID / process group, never by name.

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
[[ -x "$PYTHON" ]] || PYTHON="$(command -v python3)"

log() { printf '[%s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { printf 'error: %s\n' "$*" >&2; exit 2; }

# wait_health URL DEADLINE_S PID -> 0 once GET URL/health answers, 1 on deadline or when PID died.
wait_health() {
  local url="$1" deadline=$((SECONDS + $2)) pid="${3:-}"
  while ((SECONDS < deadline)); do
    if "$PYTHON" - "$url" <<'PY' 2>/dev/null; then return 0; fi
import sys, urllib.request
urllib.request.urlopen(sys.argv[1].rstrip("/") + "/health", timeout=2).read()
PY
    if [[ -n "$pid" ]] && ! kill -0 "$pid" 2>/dev/null; then return 1; fi
    sleep 1
  done
  return 1
}

# stop_group PGID [GRACE_S]: SIGTERM the process group, SIGKILL whatever is left after GRACE_S.
stop_group() {
  local pgid="$1" grace="${2:-20}" i
  kill -0 -- "-$pgid" 2>/dev/null || return 0
  kill -TERM -- "-$pgid" 2>/dev/null || true
  for ((i = 0; i < grace; i++)); do
    kill -0 -- "-$pgid" 2>/dev/null || return 0
    sleep 1
  done
  kill -KILL -- "-$pgid" 2>/dev/null || true
}

# stop_pid PID [GRACE_S]: SIGTERM one process, SIGKILL it after GRACE_S.
stop_pid() {
  local pid="$1" grace="${2:-10}" i
  kill -0 "$pid" 2>/dev/null || return 0
  kill -TERM "$pid" 2>/dev/null || true
  for ((i = 0; i < grace; i++)); do
    kill -0 "$pid" 2>/dev/null || { wait "$pid" 2>/dev/null; return 0; }
    sleep 1
  done
  kill -KILL "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
}
