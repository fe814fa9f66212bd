#!/usr/bin/env bash
# Install the test dependencies and run the tests: the README's second command. Run it in a
# virtual environment (python3 -m venv .venv && . .venv/bin/activate): it installs into the
# active Python. The tests run on every core (pytest-xdist, -n auto); pass pytest options
# after it (bash scripts/test.sh tests/tui -n 0).
# torch==2.13.0 first: where a CPU build of it is on local disk pip takes that one, instead of
# resolving an unpinned torch to a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q "torch==2.13.0"
python3 -m pip install -q -e ".[test]"
python3 -m pytest -q -n auto "$@"
