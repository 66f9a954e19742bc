# Shared helpers of the launch scripts (sourced, not run). Bash 4+. The scripts choose the
# interpreter here (PYTHON) and hand over to Python: `python -m launch` (launch/*.py) or, for
# micro_study.sh and sweep.sh, `python -m study`. Stopping processes is launch/procs.py's job.

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

# launch_py ARGS...: replace this shell by `python -m launch ARGS` (the repository on its path).
launch_py() {
  PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" exec "$PYTHON" -m launch "$@"
}
