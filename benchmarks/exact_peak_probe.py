"""Research probe for exact per-step peaks (issue 17): what torch's allocation history offers, what
it costs, and raw data to check a replay against torch's own per-phase peaks. GPU only.

    python benchmarks/exact_peak_probe.py --out DIR [--config tests/fixtures/configs/qwen2.5-1.5b.json]

Writes DIR/probe.json (facts and timings) and DIR/<loop>.json.gz (per step: the allocator's
segments at the step start and end, the trace-only history of the step, the allocator counters
and torch's own peak at every phase boundary, reset there: the reference a replay must match).
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
import time
import traceback

import torch

R: dict = {"torch": torch.__version__, "errors": []}
MH = torch.cuda.memory._record_memory_history


def note(k, v):
    R[k] = v
    print(f"{k}: {v}", flush=True)


def stats(dev=0):
    s = torch._C._cuda_memoryStats(dev)
    a, n = s["allocated_bytes"]["all"], s["allocation"]["all"]
    return {"cur": a["current"], "peak": a["peak"], "acum": a["allocated"], "fcum": a["freed"],
            "n_alloc": n["allocated"], "n_free": n["freed"], "n_cur": n["current"],
            "res": s["reserved_bytes"]["all"]["current"], "t": time.time(),
            "pc": time.perf_counter()}


def snap(traces: bool):
    try:
        return torch._C._cuda_memorySnapshot((0, 0, traces))
    except Exception as e:  # older signature
        R.setdefault("snap_tuple_error", repr(e))
        return torch._C._cuda_memorySnapshot(None)


def segs(s):
    out = []
    for sg in s["segments"]:
        if sg.get("device", 0) != 0:
            continue
        out.append([sg["address"], sg["total_size"], sg["segment_type"], sg["stream"],
                    bool(sg.get("is_expandable", False)), list(sg.get("segment_pool_id", (0, 0))),
                    [[b["address"], b["size"], b["requested_size"], b["state"]]
                     for b in sg["blocks"]]])
    return out


def trace(s):
    tr = s.get("device_traces") or [[]]
    tr = tr[0] if tr else []
    return [[e["action"], e.get("addr", 0), e["size"], e.get("stream", 0), e.get("time_us", 0),
             len(e.get("frames") or ())] for e in tr]


def trace_only(clear=True, max_entries=1_000_000):
    MH(enabled="all", context=None, stacks="python", max_entries=max_entries,
       clear_history=clear)


def timeit(fn, n=5):
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def semantics():
    MH(None)
    trace_only(clear=False, max_entries=1000)
    x = torch.empty(1000, device="cuda")
    del x
    note("entries_after_one_alloc_free", [e[0] for e in trace(snap(True))])
    note("entries_after_second_snapshot", [e[0] for e in trace(snap(True))])
    MH(None)
    note("entries_after_disable", len(trace(snap(True))))
    trace_only(clear=False, max_entries=1000)
    y = torch.empty(1000, device="cuda")
    del y
    note("entries_after_reenable", [e[0] for e in trace(snap(True))])
    trace_only(clear=True, max_entries=1000)
    note("entries_after_clear", [e[0] for e in trace(snap(True))])
    # the clock
    t0 = time.time()
    z = torch.empty(4096, device="cuda")
    t1 = time.time()
    del z
    tr = trace(snap(True))
    al = [e for e in tr if e[0] == "alloc"][-1]
    note("time_us_minus_unix_us", [al[4] - int(t0 * 1e6), al[4] - int(t1 * 1e6)])
    note("frames_trace_only", al[5])
    s = snap(True)["device_traces"][0][-1]
    note("trace_entry_keys", sorted(s.keys()))
    MH(enabled="all", context="all", stacks="python", max_entries=1000)
    w = torch.empty(2048, device="cuda")
    del w
    tr = trace(snap(True))
    note("frames_with_context", [e[5] for e in tr if e[0] == "alloc"][-1:])
    note("is_enabled_fn", bool(torch._C._cuda_isHistoryEnabled()))
    MH(None)
    note("is_enabled_after_off", bool(torch._C._cuda_isHistoryEnabled()))
    # per-event cost: alloc+free of a small tensor, history off / trace-only / python stacks
    def loop(n=20000):
        t = time.perf_counter()
        for _ in range(n):
            torch.empty(256, device="cuda")
        return (time.perf_counter() - t) / n
    loop(2000)
    res = {}
    for mode in ("off", "trace", "stacks", "off2", "trace2"):
        MH(None)
        if mode.startswith("trace"):
            trace_only(max_entries=100_000)
        elif mode == "stacks":
            MH(enabled="all", context="all", stacks="python", max_entries=100_000)
        res[mode] = round(loop() * 1e9)
    MH(None)
    note("ns_per_alloc_free_pair", res)


def mlp(args):
    torch.manual_seed(0)
    blocks = []
    for _ in range(24):
        blocks += [torch.nn.Linear(256, 256), torch.nn.LayerNorm(256), torch.nn.GELU()]
    model = torch.nn.Sequential(*blocks).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(32, 256, device="cuda")

    def step():
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(5):
        step()
    torch.cuda.synchronize()

    def block(n=30):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(n):
            step()
        torch.cuda.synchronize()
        return (time.perf_counter() - t) / n

    on, off = [], []
    for rep in range(6):
        MH(None)
        off.append(block())
        trace_only()
        on.append(block())
    MH(None)
    note("mlp_step_ms_off_on", [round(statistics.median(off) * 1e3, 3),
                                round(statistics.median(on) * 1e3, 3)])
    note("mlp_recording_ratio_pct", round(100 * (statistics.median(
        [a / b for a, b in zip(on, off)]) - 1), 2))
    trace_only()
    step()
    n_entries = len(trace(snap(True)))
    note("mlp_entries_per_step", n_entries)
    note("mlp_blocks", sum(len(s[6]) for s in segs(snap(False))))
    note("mlp_snapshot_segments_us", round(timeit(lambda: snap(False)) * 1e6))
    note("mlp_snapshot_full_us", round(timeit(lambda: snap(True)) * 1e6))
    note("mlp_record_on_off_us", round(timeit(lambda: (MH(None), trace_only())) * 1e6))
    note("mlp_stats_us", round(timeit(lambda: torch._C._cuda_memoryStats(0), 50) * 1e6, 1))
    MH(None)
    # the profiler's memory events, for comparison
    try:
        from torch.profiler import ProfilerActivity, profile
        t_on = []
        for _ in range(3):
            with profile(activities=[ProfilerActivity.CPU], profile_memory=True):
                t_on.append(block(10))
        t_off = [block(10) for _ in range(3)]
        note("mlp_profiler_step_ms_off_on", [round(statistics.median(t_off) * 1e3, 3),
                                             round(statistics.median(t_on) * 1e3, 3)])
    except Exception as e:
        R["errors"].append(f"profiler: {e!r}")
    record_steps("mlp", step_parts=lambda: [
        ("other", lambda: opt.zero_grad(set_to_none=True)),
        ("forward", lambda: st.__setitem__("loss", model(x).square().mean())),
        ("backward", lambda: (st["loss"].backward(), st.pop("loss"))),
        ("optimizer", lambda: opt.step())], n=4, out=args.out)


st: dict = {}


def record_steps(name, step_parts, n, out):
    """n steps, each recorded trace-only from its start, with torch's own peak per phase."""
    steps = []
    for k in range(n):
        t = time.perf_counter()
        seg0 = snap(False)
        t_seg = time.perf_counter() - t
        t = time.perf_counter()
        trace_only()
        t_on = time.perf_counter() - t
        b = [dict(stats(), phase="start")]
        torch.cuda.reset_peak_memory_stats()
        for ph, fn in step_parts():
            fn()
            s = stats()
            s["phase"] = ph
            b.append(s)
            torch.cuda.reset_peak_memory_stats()
        t = time.perf_counter()
        full = snap(True)
        t_full = time.perf_counter() - t
        tr = trace(full)
        t = time.perf_counter()
        cur, mx = b[0]["cur"], 0
        for e in tr:  # the Python cost of a minimal replay (rounded sizes)
            if e[0] == "alloc":
                cur += (e[2] + 511) // 512 * 512
                mx = max(mx, cur)
            elif e[0] == "free_requested":
                cur -= (e[2] + 511) // 512 * 512
        t_replay = time.perf_counter() - t
        steps.append({"segments0": segs(seg0), "segments1": segs(full), "trace": tr,
                      "boundaries": b, "cost_us": {"snap_segments": round(t_seg * 1e6),
                                                   "record_on": round(t_on * 1e6),
                                                   "snap_full": round(t_full * 1e6),
                                                   "replay_min": round(t_replay * 1e6)}})
        print(f"{name} step {k}: {len(tr)} entries, {sum(len(s[6]) for s in segs(full))} blocks,"
              f" costs {steps[-1]['cost_us']}, phase peaks "
              f"{[(x['phase'], round(x['peak'] / 2**30, 3)) for x in b[1:]]}", flush=True)
    MH(None)
    with gzip.open(os.path.join(out, f"{name}.json.gz"), "wt") as f:
        json.dump(steps, f)
    R[f"{name}_costs"] = [s["cost_us"] for s in steps]
    R[f"{name}_entries"] = [len(s["trace"]) for s in steps]


def qwen(args, batches):
    from blog_model import build  # benchmarks/ (this script's folder)
    torch.manual_seed(0)
    t = time.time()
    model, config = build(torch, "cuda", args.config)
    note("qwen_build_s", round(time.time() - t, 1))
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    for batch in batches:
        ids = torch.randint(0, config.vocab_size, (batch, 256), device="cuda")

        def fwd():
            st["loss"] = model(input_ids=ids, labels=ids).loss

        def parts():
            return [("other", lambda: opt.zero_grad(set_to_none=True)), ("forward", fwd),
                    ("backward", lambda: (st["loss"].backward(), st.pop("loss"))),
                    ("optimizer", lambda: opt.step())]

        def step():
            for _, fn in parts():
                fn()

        step()
        step()
        torch.cuda.synchronize()

        def block(n):
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(n):
                step()
            torch.cuda.synchronize()
            return (time.perf_counter() - t) / n

        on, off = [], []
        for rep in range(3):
            MH(None)
            off.append(block(2))
            trace_only()
            on.append(block(2))
        MH(None)
        note(f"qwen_b{batch}_step_ms_off_on", [round(statistics.median(off) * 1e3, 2),
                                               round(statistics.median(on) * 1e3, 2)])
        record_steps(f"qwen_b{batch}", parts, n=8, out=args.out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--config", default="tests/fixtures/configs/qwen2.5-1.5b.json")
    ap.add_argument("--skip-qwen", action="store_true")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    torch.cuda.init()
    torch.empty(1, device="cuda")
    note("device", torch.cuda.get_device_name())
    note("allocator_settings", snap(False).get("allocator_settings"))
    for name, fn in (("semantics", semantics), ("mlp", lambda: mlp(args)),
                     ("qwen", lambda: None if args.skip_qwen else qwen(args, (2, 16)))):
        t = time.time()
        try:
            fn()
        except Exception:
            R["errors"].append(f"{name}: {traceback.format_exc()}")
            print(traceback.format_exc(), flush=True)
        note(f"section_{name}_s", round(time.time() - t, 1))
        with open(os.path.join(args.out, "probe.json"), "w") as f:
            json.dump(R, f, indent=1)


if __name__ == "__main__":
    main()
