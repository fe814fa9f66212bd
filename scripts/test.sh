#!/usr/bin/env bash
# Install the test dependencies and run the tests: the README's second command. Run it in a
# virtual environment (python3 -m venv .venv && . .venv/bin/activate): it installs into the
# active Python. The tests run on every core (pytest-xdist, -n auto); pass pytest options
# after it (bash scripts/test.sh tests/tui -n 0).
# torch==2.13.0 first: where a CPU build of it is on local disk pip takes that one, instead of
# resolving an unpinned torch to a multi-GB CUDA build. GPUMON_TORCH picks another version (the
# oldest-torch leg, docs/development.md: GPUMON_TORCH=2.11.0, from PyPI the 4.6 GB CUDA build;
# GPUMON_TORCH_INDEX=https://download.pytorch.org/whl/cpu takes the CPU build where reachable).
# The frameworks extra (transformers, accelerate, lightning) makes the README's framework and
# architecture claims run, not skip.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q "torch==${GPUMON_TORCH:-2.13.0}" \
  ${GPUMON_TORCH_INDEX:+--index-url "$GPUMON_TORCH_INDEX" --extra-index-url https://pypi.org/simple}
python3 -m pip install -q -e ".[test,frameworks]"
python3 -m pytest -q -n auto "$@"
