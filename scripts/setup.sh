#!/usr/bin/env bash
# Sets up everything from nothing (Rust, gcc, Python >= 3.11 and pip are assumed; torch is not),
# then runs one job:
#   scripts/setup.sh demo   the main job (trains the embedded MoE model under every arm), then
#                           the lifetime A/B (GPU: measured figures; CPU: numerics only)
#   scripts/setup.sh test   Rust tests + pytest (GPU tests skip without a GPU)
# Re-running is incremental: the venv, pip cache and cargo target dir are reused.
# Which torch: requirements-dev.txt (2.15.0, the newest on the index, with torchtitan 0.3.0; what
# CI runs), or another file through SCHED_LIFETIME_REQUIREMENTS, e.g. requirements-torch2.11.txt
# (the GPU machine's); SCHED_LIFETIME_VENV puts that one in its own venv (default .venv).
set -euo pipefail
cd "$(dirname "$0")/.."
job=${1:-}
case "$job" in demo|test) ;; *) echo "usage: $0 demo|test" >&2; exit 2 ;; esac

BOOT=${PYTHON_BOOTSTRAP:-python3}
REQS=${SCHED_LIFETIME_REQUIREMENTS:-requirements-dev.txt}
VENV=${SCHED_LIFETIME_VENV:-.venv}
case "$VENV" in /*) ;; *) VENV="$PWD/$VENV" ;; esac
if [ ! -x "$VENV/bin/python" ]; then
  # torch 2.15.0 and torchtitan 0.3.0 (requirements-dev.txt) have no wheels for Python 3.10.
  if [ "$REQS" = requirements-dev.txt ] && ! "$BOOT" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
    echo "scripts/setup.sh: $("$BOOT" --version 2>&1) is too old for requirements-dev.txt (torch 2.15.0, torchtitan 0.3.0 need Python >= 3.11);" \
      "set PYTHON_BOOTSTRAP to a Python 3.11+, or SCHED_LIFETIME_REQUIREMENTS=requirements-torch2.11.txt" >&2
    exit 2
  fi
  "$BOOT" -m venv "$VENV"
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"
export PYTHON="$VENV/bin/python"   # build.rs asks this interpreter where torch is
python -m pip install -q --disable-pip-version-check -r "$REQS"
# Builds the Rust cdylib (feature torch) into torch_ops/sched_lifetime/ and installs the package.
python -m pip install -q --disable-pip-version-check --no-build-isolation -e .

case "$job" in
  demo)
    python -m sched_lifetime train
    python -m sched_lifetime demo
    ;;
  test)
    cargo test --all-targets
    python -m pytest -q tests/python
    ;;
esac
