#!/usr/bin/env bash
# Run on the GPU machine (device tool) from the repo root: installs the carried wheels, then runs
# the named sections, logging each to $OUT/<section>.log. Sections are independent; one failing
# does not stop the next. Usage: bash scripts/gpu_session.sh probe tests fixtures bench shots
set -u
OUT=${OUT:-/tmp/gpumon-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
# The GPU machine has no gdb (needed by `gpumon inject` on Python < 3.14): use a carried build.
if ! command -v gdb >/dev/null && [ -f .gdb/gdb.tar.xz ]; then
  tar xJf .gdb/gdb.tar.xz -C /tmp && export PATH=/tmp/gdbpack/bin:$PATH
  [ -d /usr/lib/python3.11 ] || cp -r /tmp/gdbpack/py/lib/python3.11 /usr/lib/  # gdb's own Python
fi
section() {
  local name=$1; shift
  echo "=== $name: $*"
  ( set -o pipefail; timeout "${T:-400}" "$@" 2>&1 | tee "$OUT/$name.log" | tail -25 )
  echo "=== $name rc=$?"
}
for s in "$@"; do
  case $s in
    probe) section probe bash -c 'nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; which gdb; gdb --version | head -1; ls /usr/bin/python3*; python3 -c "import torch,sys;print(sys.version, torch.__version__)"; cat /proc/sys/kernel/yama/ptrace_scope 2>/dev/null; nproc' ;;
    tests) section gputests python3 -m pytest tests/gpu -q -rs -p no:cacheprovider --timeout 300 ;;
    fixtures) section fixtures python3 scripts/make_snapshot_fixtures.py && tar czf "$OUT/fixtures.tgz" tests/fixtures/snapshots ;;
    estimate) T=420 section estimate python3 benchmarks/estimate_accuracy.py --out "$OUT/estimate_accuracy.md" ;;
    overhead) section overhead python3 benchmarks/agent_overhead.py --reps ${REPS:-20} --steps 200 --out "$OUT/agent_overhead.md" ;;
    phasesbench) section phasesbench python3 benchmarks/phases_overhead.py --out "$OUT/phases_overhead.md" ;;
    shots) section shots python3 scripts/make_screenshots.py --gpu --out "$OUT/shots" && tar czf "$OUT/shots.tgz" -C "$OUT" shots && rm -rf "$OUT/shots" ;;
    *) echo "unknown section $s" ;;
  esac
done
