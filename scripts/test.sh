#!/usr/bin/env bash
# Install the test dependencies and run the tests: the README's second command.
# torch==2.13.0 first: where a CPU build of it is on local disk pip takes that one, instead of
# resolving an unpinned torch to a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q "torch==2.13.0"
python3 -m pip install -q -e ".[test]"
python3 -m pytest -q "$@"
