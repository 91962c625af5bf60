#!/usr/bin/env bash
# Sets up everything from nothing (Rust, gcc, Python >= 3.10 and pip are assumed; torch is not),
# then runs one job:
#   scripts/setup.sh demo   the main job (trains the embedded MoE model under every arm), then
#                           the lifetime A/B (GPU: measured figures; CPU: numerics only)
#   scripts/setup.sh test   Rust tests + pytest (GPU tests skip without a GPU)
# Re-running is incremental: the venv, pip cache and cargo target dir are reused.
set -euo pipefail
cd "$(dirname "$0")/.."
job=${1:-}
case "$job" in demo|test) ;; *) echo "usage: $0 demo|test" >&2; exit 2 ;; esac

BOOT=${PYTHON_BOOTSTRAP:-python3}
if [ ! -x .venv/bin/python ]; then
  "$BOOT" -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
export PYTHON="$PWD/.venv/bin/python"   # build.rs asks this interpreter where torch is
python -m pip install -q --disable-pip-version-check -r requirements-dev.txt
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
