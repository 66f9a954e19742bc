# Shared helpers of the launch scripts (sourced, not run). Bash 4+.
# Every process a script starts is stopped by its PID / process group, never by name.

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

log() { printf '[%s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { printf 'error: %s\n' "$*" >&2; exit 2; }

# has_verl PY -> 0 when interpreter PY can import verl (checked without importing it).
has_verl() {
  [[ -n "$1" ]] && "$1" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("verl") is None)' 2>/dev/null
}

# resolve_python: sets and exports PYTHON, the interpreter every launch script uses, and says which
# one on stderr. Order: 1. $PYTHON (an explicit choice, used as given); 2. the active virtualenv
# ($VIRTUAL_ENV/bin/python); 3. the active conda env ($CONDA_PREFIX/bin/python); 4. `python`, else
# `python3`, on PATH. The environment a user installed `.[gpu]` into therefore wins over the repo's
# .venv (the CPU set of `make venv`), which is used only when choices 2-4 cannot import verl and it can.
resolve_python() {
  local choice why
  if [[ -n "${PYTHON:-}" ]]; then
    choice="$(command -v "$PYTHON" 2>/dev/null)" || die "PYTHON=$PYTHON is not an executable"
    why="PYTHON"
  elif [[ -n "${VIRTUAL_ENV:-}" && -x "$VIRTUAL_ENV/bin/python" ]]; then
    choice="$VIRTUAL_ENV/bin/python" why="active virtualenv"
  elif [[ -n "${CONDA_PREFIX:-}" && -x "$CONDA_PREFIX/bin/python" ]]; then
    choice="$CONDA_PREFIX/bin/python" why="active conda env"
  else
    choice="$(command -v python 2>/dev/null || command -v python3 2>/dev/null || true)" why="python on PATH"
  fi
  if [[ "$why" != PYTHON ]] && ! has_verl "$choice" && has_verl "$ROOT/.venv/bin/python"; then
    why="the repo's .venv; $why (${choice:-none}) cannot import verl"
    choice="$ROOT/.venv/bin/python"
  fi
  [[ -n "$choice" ]] || die "no python found: activate the environment the project is installed in, or set PYTHON=/path/to/python"
  PYTHON="$choice"
  export PYTHON  # scripts this one starts (sweep.sh -> run.sh) keep the same interpreter
  log "python: $PYTHON ($why)"
}

# need_verl: stop unless $PYTHON can import verl, naming the interpreter and the fix.
need_verl() {
  has_verl "$PYTHON" || die "$PYTHON cannot import verl: install the project into it (CPU: make venv; GPU: see README 'GPU node') or point PYTHON=/path/to/python at the environment that has it"
}

resolve_python

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

# probe_retrieve URL REQUIRE_HITS -> 0 when one real POST URL/retrieve answers with a well-formed
# result (and, when REQUIRE_HITS is 1, at least one passage: a dense index always has neighbours);
# otherwise prints the failure (HTTP status and the server's error text) on stdout and returns 1.
# /health never searches, so this is the check that a backend can actually answer a query.
probe_retrieve() {
  "$PYTHON" - "$1" "$2" <<'PY'
import json, sys, urllib.error, urllib.request
url, require_hits = sys.argv[1].rstrip("/"), sys.argv[2] == "1"
body = json.dumps({"queries": ["who wrote the first american novel"], "topk": 1}).encode()
request = urllib.request.Request(url + "/retrieve", data=body, headers={"Content-Type": "application/json"})
try:
    with urllib.request.urlopen(request, timeout=120) as answer:
        doc = json.loads(answer.read())
except urllib.error.HTTPError as err:
    sys.exit(print(f"POST {url}/retrieve answered HTTP {err.code}: {err.read().decode(errors='replace')[:600]}") or 1)
except (OSError, ValueError) as err:
    sys.exit(print(f"POST {url}/retrieve failed: {type(err).__name__}: {err}") or 1)
result = doc.get("result") if isinstance(doc, dict) else None
if not isinstance(result, list) or len(result) != 1 or not isinstance(result[0], list):
    sys.exit(print(f"POST {url}/retrieve answered without one result list per query: {str(doc)[:300]}") or 1)
if require_hits and not result[0]:
    sys.exit(print(f"POST {url}/retrieve returned no passage for a plain query (empty or broken index?)") or 1)
PY
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
