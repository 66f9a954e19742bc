#!/usr/bin/env bash
# The retriever a recipe describes, in the foreground: bash launch/serve_retriever.sh RECIPE [overrides] [-- serve flags]
set -euo pipefail; source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"; need_verl; launch_py retriever "$@"
