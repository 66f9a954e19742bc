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

# group_alive PGID -> 0 while a process of the group is running (zombies do not count).
group_alive() {
  ps -eo pgid=,stat= | awk -v g="$1" '$1 == g && $2 !~ /^Z/ { found = 1 } END { exit !found }'
}

# pid_alive PID -> 0 while the process is running (a zombie does not count).
pid_alive() {
  local stat
  stat="$(ps -o stat= -p "$1" 2>/dev/null)" || return 1
  [[ -n "$stat" && "$stat" != Z* ]]
}

# stop_group PGID [GRACE_S]: SIGTERM the process group, SIGKILL whatever is left after GRACE_S.
stop_group() {
  local pgid="$1" grace="${2:-20}" i
  group_alive "$pgid" || return 0
  kill -TERM -- "-$pgid" 2>/dev/null || true
  for ((i = 0; i < grace * 5; i++)); do
    group_alive "$pgid" || return 0
    sleep 0.2
  done
  kill -KILL -- "-$pgid" 2>/dev/null || true
}

# stop_pid PID [GRACE_S]: SIGTERM one child process, SIGKILL it after GRACE_S, then reap it.
stop_pid() {
  local pid="$1" grace="${2:-10}" i
  if pid_alive "$pid"; then
    kill -TERM "$pid" 2>/dev/null || true
    for ((i = 0; i < grace * 5; i++)); do
      pid_alive "$pid" || break
      sleep 0.2
    done
    pid_alive "$pid" && kill -KILL "$pid" 2>/dev/null
  fi
  wait "$pid" 2>/dev/null || true
}
