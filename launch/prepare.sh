#!/usr/bin/env bash
# Fetch what the GPU recipes need, into the paths recipes/base.yaml expects.
#
#   bash launch/prepare.sh [all|model|encoder|corpus|index|data ...]     (default: all)
#   bash launch/prepare.sh --check                                       (only list what is missing)
#   bash launch/prepare.sh --pin-on-first-download [targets]             (record unknown pins: TOFU)
#
# Targets, sources and sizes: bash launch/prepare.sh --help (launch/prepare.py). Model, encoder and
# index are fetched at the commit launch/pins.json names and checked against its sha256 (docs/gpu.md,
# "Pinned downloads"). Existing files are kept. Without network access nothing is downloaded; each
# missing item is listed with its path and the command that provides it. Environment: DATA_DIR
# [data], INDEX_SOURCE [study|flat], PYTHON.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"
launch_py prepare "$@"
