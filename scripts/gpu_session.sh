#!/usr/bin/env bash
# Run on the GPU machine (device tool) from the repo root: installs the carried wheels, then runs
# the named sections, logging each to <section>.log. Sections are independent; one failing
# does not stop the next. Usage: bash scripts/gpu_session.sh probe tests fixtures bench shots
# The device tool brings back at most 8 files from $OUT, so everything is written under $W and
# packed into the one file $OUT/session.tgz after every section (a run cut short keeps the rest).
set -u
OUT=${OUT:-/tmp/gpumon-out}; mkdir -p "$OUT"
W=/tmp/gpumon-session; rm -rf "$W"; mkdir -p "$W"
pack() { tar czf "$OUT/.session.tgz" -C "$W" . && mv "$OUT/.session.tgz" "$OUT/session.tgz"; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
# The GPU machine has no gdb (needed by `gpumon inject` on Python < 3.14): use the bundle that
# scripts/make_gdb_bundle.sh makes (carry .gdb).
if ! command -v gdb >/dev/null && [ -f .gdb/gdb-bundle.tar.xz ]; then
  mkdir -p /tmp/gdb && tar xJf .gdb/gdb-bundle.tar.xz -C /tmp/gdb && export GPUMON_GDB=/tmp/gdb/gdb
fi
section() {
  local name=$1; shift
  echo "=== $name: $*"
  ( set -o pipefail; timeout "${T:-400}" "$@" 2>&1 | tee "$W/$name.log" | tail -25 )
  echo "=== $name rc=$?" | tee -a "$W/$name.log"
  pack
}
for s in "$@"; do
  case $s in
    probe) section probe bash -c 'nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; which gdb; ${GPUMON_GDB:-gdb} --version | head -1; ls /usr/bin/python3*; python3 -c "import torch,sys;print(sys.version, torch.__version__, \"cudnn\", torch.backends.cudnn.version())"; python3 -c "import transformers;print(\"transformers\", transformers.__version__)"; cat /proc/sys/kernel/yama/ptrace_scope 2>/dev/null; nproc' ;;
    tests) section gputests python3 -m pytest tests/gpu -v -s -rs -p no:cacheprovider --timeout 300 ;;
    fixtures) section fixtures python3 scripts/make_snapshot_fixtures.py && cp -r tests/fixtures/snapshots "$W/fixtures" ;;
    estimate) T=420 section estimate python3 benchmarks/estimate_accuracy.py --out "$W/estimate_accuracy.md" ;;
    overhead) section overhead python3 benchmarks/agent_overhead.py --reps ${REPS:-10} ${OVERHEAD_ARGS:-} --out "$W/agent_overhead.md" ;;
    overhead-nophases) section overhead-nophases python3 benchmarks/agent_overhead.py --no-phases --reps ${REPS:-10} ${OVERHEAD_ARGS:-} --out "$W/agent_overhead.md" ;;
    tuicost) section tuicost python3 benchmarks/tui_cost.py --seconds ${TUI_S:-20} --out "$W/tui_cost.md" ;;
    phasesbench) section phasesbench python3 benchmarks/phases_overhead.py --out "$W/phases_overhead.md" ;;
    # issue 35: the phase tracker's own time per boundary with the real torch._C reads (vs the CPU fake)
    boundarycost) T=120 section boundarycost python3 benchmarks/boundary_cost.py --device cuda --steps 3000 ;;
    shots) section shots python3 scripts/make_screenshots.py --cmd "python3 examples/train.py" --prefix gpu- --wait ${SHOT_WAIT:-25} && mkdir -p "$W/shots" && cp screenshots/gpu-* "$W/shots/" ;;
    estgpu) section estgpu python3 -m pytest tests/gpu/test_estimate_gpu.py -v -s -rs -p no:cacheprovider --timeout 300 ;;
    estrows) T=${T:-500} section estrows python3 benchmarks/estimate_accuracy.py --rows default --out "$W/estimate_accuracy.md" ;;
    # issue 34: held-out architectures in both modes (dropout, bf16 math, eager long seq, MLA, multimodal, measure-only types)
    estheld) T=${T_EST:-300} section estheld python3 benchmarks/estimate_accuracy.py --rows held --budget-s 200 --workers 8 --out "$W/estimate_accuracy_held.md" ;;
    # issue 34: MLA (DeepSeek-V2/V3) in the formula: its rows against requested_bytes.all.peak (<= 150 s)
    estmla) T=${T_EST:-200} section estmla python3 -m pytest tests/gpu/test_estimate_gpu.py -k "mla" -v -s -rs -p no:cacheprovider --timeout 200 ;;
    estmoe) section estmoe python3 benchmarks/estimate_accuracy.py --rows all --only moe- --only mistral-sw --out "$W/estimate_accuracy_moe_sw.md" ;;
    anatomy) section anatomy python3 benchmarks/estimate_anatomy.py --only mha-forloop-b1-mean --only mha-adafactor-b1-mean --only 0.5b-bf16-b1-mean --only 0.5b-amp-b1-mean --only 0.5b-adafactor-b1-mean --only 0.5b-fp32-b2 --out "$W/estimate_anatomy.md" ;;
    agenttests) section agenttests python3 -m pytest tests/gpu/test_agent_gpu.py -v -s -rs -p no:cacheprovider --timeout 300 ;;
    # what the 2026-12-05 CPU fixes still owe the GPU: the b16 step events, capture's snapshot
    # markers, the view's block peak, BERT with dropout, MoE and sliding-window --measure
    pending) section pending python3 -m pytest tests/gpu/test_phases_gpu.py tests/gpu/test_capture_gpu.py tests/gpu/test_view_blocks_gpu.py tests/gpu/test_view_gpu.py tests/gpu/test_estimate_gpu.py -k "not test_estimate_gpu or mixture or bert or sliding_window_step" -v -s -rs -p no:cacheprovider --timeout 300 ;;
    # pending, split so that each part has its own time limit inside one 600 s device call
    viewcap) T=${T_VIEWCAP:-200} section viewcap python3 -m pytest tests/gpu/test_capture_gpu.py tests/gpu/test_view_blocks_gpu.py tests/gpu/test_view_gpu.py -v -s -rs -p no:cacheprovider --timeout 200 ;;
    estpending) T=${T_EST:-170} section estpending python3 -m pytest tests/gpu/test_estimate_gpu.py -k "mixture or bert or sliding_window_step" -v -s -rs -p no:cacheprovider --timeout 170 ;;
    swstep) T=${T_EST:-90} section swstep python3 -m pytest tests/gpu/test_estimate_gpu.py -k "sliding_window_step or mixture" -v -s -rs -p no:cacheprovider --timeout 120 ;;
    phases) T=${T_PHASES:-400} section phases python3 -m pytest tests/gpu/test_phases_gpu.py -v -s -rs -p no:cacheprovider --timeout 300 ;;
    # issue 19: what is live at the sliding-window and MoE rows' peaks, by the C++ frame that allocated it
    anatomysw) T=${T_ANAT:-200} section anatomysw python3 benchmarks/estimate_anatomy.py --stacks all ${ANAT_ONLY:---only mistral-sw-fp32-b2 --only mistral-sw-short-b8 --only mistral-sw-bf16-b4 --only moe-mixtral-bf16-b16-mean} --out "$W/anatomy_sw.md" ;;
    samplercost) section samplercost python3 benchmarks/sampler_cost.py ${SC_ARGS:-} --out "$W/sampler_cost.md" ;;
    samplercost-nophases) section samplercost-nophases python3 benchmarks/sampler_cost.py --no-phases ${SC_ARGS:-} --out "$W/sampler_cost.md" ;;
    # the same benchmark on another tree (e.g. the commit before a change, unpacked into .cmp/old)
    samplercost-old) section samplercost-old env PYTHONPATH=$PWD/.cmp/old:/tmp/site python3 .cmp/old/benchmarks/sampler_cost.py --no-phases --label "tree ${OLD_LABEL:-old}" ${SC_ARGS:-} --out "$W/sampler_cost.md" ;;
    modules) T=${T_MODULES:-150} section modules python3 -m pytest tests/gpu/test_modules_gpu.py -v -s -rs -p no:cacheprovider --timeout 150 ;;
    # real everyday snapshots (stacks='all' and python) for the viewer's speed benchmark and tests
    realsnaps) section realsnaps bash -c "python3 scripts/make_real_snapshots.py $W/realsnaps" ;;
    # issue 32: an armed snapshot before CUDA records the first steps; the demo with CUDA starts clean
    firsthour) T=${T_FIRST:-150} section firsthour python3 -m pytest tests/gpu/test_first_hour_gpu.py -v -s -rs -p no:cacheprovider --timeout 140 ;;
    # issue 30: a torch.compile'd transformer plain vs under gpumon run (graphs, breaks, step time)
    compat) T=${T_COMPAT:-150} section compat python3 -m pytest tests/gpu/test_compat_gpu.py -v -s -rs -p no:cacheprovider --timeout 150 && cp benchmarks/compat_gpu.md "$W/compat_gpu.md" ;;
    # issue 30: strict torch.export between training steps on the GPU machine's torch (gpumon steps aside)
    strictexport) T=${T_STRICT:-150} section strictexport python3 -m pytest tests/phases/test_tracker.py tests/compat/test_model_ops.py -k "strict_export or same_with_gpumon or plain_run" -v -rs -p no:cacheprovider --timeout 150 ;;
    # issue 32 item 8: `gpumon inject` end to end on CPU and GPU targets (gdb: carry .gdb)
    injecttime) T=${T_INJ:-150} section injecttime python3 benchmarks/inject_time.py --device cuda --rounds ${INJ_ROUNDS:-2} --out "$W/inject_time.json" ;;
    # issue 33: gradients named at the blog loop's optimizer-step peak, stacks Python first
    viewnames) T=${T_VIEWNAMES:-150} section viewnames python3 -m pytest tests/gpu/test_view_names_gpu.py -v -s -rs -p no:cacheprovider --timeout 150 ;;
    # issue 35: every step's exact peak from torch's counters (the blog loop's b2/b16 tests, every step exact vs torch's per-phase resets) and its cost on the blog loop
    steps) T=${T_STEPS:-200} section steps bash -c "python3 -m pytest tests/gpu/test_phases_gpu.py -v -s -rs -p no:cacheprovider --timeout 150 && python3 benchmarks/phases_overhead.py --workload blog --reps 6 --steps 8 --out $W/phases_overhead_blog.md" ;;
    # issue 35: the program's own view of torch's peak counters unchanged by gpumon (plain vs gpumon run vs gpumon.start(), memory_summary included) and every step exact in its phase (the counters program and a HF Trainer)
    counters) T=${T_COUNTERS:-150} section counters python3 -m pytest tests/gpu/test_counters_gpu.py -v -s -rs -p no:cacheprovider --timeout 140 ;;
    # issue 35: the tracker's cost side by side (off / phases chunks interleaved in one run) on a Hugging Face Trainer run and on the blog loop
    trainerbench) T=${T_TB:-200} section trainerbench bash -c "python3 benchmarks/phases_overhead.py --workload trainer --reps ${TB_REPS:-6} --steps ${TB_STEPS:-8} ${TB_ARGS:-} --out $W/phases_overhead_trainer.md && python3 benchmarks/phases_overhead.py --workload blog --reps ${TB_REPS:-6} --steps ${TB_STEPS:-8} --out $W/phases_overhead_blog.md" ;;
    # issue 35: the Trainer alone (TB_ARGS, e.g. --gc-freeze --calibrate-us 0)
    trainer1) T=${T_TB:-200} section trainer1 python3 benchmarks/phases_overhead.py --workload trainer --reps ${TB_REPS:-6} --steps ${TB_STEPS:-8} ${TB_ARGS:-} --out $W/phases_overhead_trainer.md ;;
    # issue 35: the blog loop alone (TB_ARGS as for trainer1)
    blog1) T=${T_TB:-200} section blog1 python3 benchmarks/phases_overhead.py --workload blog --reps ${TB_REPS:-6} --steps ${TB_STEPS:-8} ${TB_ARGS:-} --out $W/phases_overhead_blog.md ;;
    # issue 35: the blog loop side by side when it reads loss.item() at every step's end (the GPU idle when the next step's first boundary runs)
    itembench) T=${T_TB:-200} section itembench python3 benchmarks/phases_overhead.py --workload blog --item --reps ${TB_REPS:-6} --steps ${TB_STEPS:-8} ${TB_ARGS:-} --out $W/phases_overhead_blog_item.md ;;
    # issue 35: what one read of torch's counters costs through each entry point (tight loop)
    readcost) T=60 section readcost python3 -c "
import time, torch
torch.zeros(1, device='cuda'); C = torch._C
def t(name, f, n=2000):
    f(); t0 = time.perf_counter()
    for _ in range(n): f()
    print(f'{name}: {1e6 * (time.perf_counter() - t0) / n:.1f} us')
t('_cuda_memoryStats', lambda: C._cuda_memoryStats(0))
t('_accelerator_getDeviceStats', lambda: C._accelerator_getDeviceStats(0)) if hasattr(C, '_accelerator_getDeviceStats') else None
t('_cuda_resetPeakMemoryStats', lambda: C._cuda_resetPeakMemoryStats(0))
t('memory_allocated', lambda: torch.cuda.memory_allocated(0))
t('mem_get_info', lambda: torch.cuda.mem_get_info(0))
print(len(str(C._cuda_memoryStats(0))), 'chars')
" ;;
    # issue 35: where the tracker's time goes inside the real loops (timers around the counters' read/reset and the tracker's boundary)
    boundaryloop) T=${T_BL:-150} section boundaryloop bash -c "python3 benchmarks/boundary_inloop.py --workload blog && python3 benchmarks/boundary_inloop.py --workload mlp" ;;
    *) echo "unknown section $s" ;;
  esac
  pack  # again: some sections copy their results after the section itself
done
