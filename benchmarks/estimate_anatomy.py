"""What is live at a training step's peak on the GPU, by where it was allocated: to find what an
estimate row misses. For the rows of benchmarks/estimate_accuracy.py.

    python benchmarks/estimate_anatomy.py --only mha-forloop-b1-mean [--only ...] [--out anatomy.md]

Each row: build, one warm-up step, then one step under torch.cuda.memory._record_memory_history.
The trace's allocations (requested sizes) are replayed from the step's start (the bytes live then:
parameters, optimizer state, cuBLAS workspaces...) to the peak of requested bytes; what is live at
that moment is grouped by the innermost frame in torch.optim / transformers / torch.nn / the step,
and printed beside the estimate's terms. Also: max_memory_allocated, the requested peak (their
difference is the allocator's rounding) and the bytes live before the step.
"""
from __future__ import annotations

import argparse
import re
import sys
from collections import defaultdict, deque
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import estimate_accuracy as bench  # noqa: E402

MiB = 2**20


def where(frames) -> str:
    for f in frames or []:
        fn = f.get("filename", "")
        if any(k in fn for k in ("torch/optim", "transformers/", "torch/nn/", "estimate_anatomy", "torch/autograd")):
            short = fn.split("site-packages/")[-1]
            return f"{short}:{f.get('line')} {f.get('name')}"
    op = cpp_op(frames)
    if op:
        return op
    return "(no Python frame: C++ / autograd engine)" if frames is not None else "(before recording)"


_SKIP = re.compile(r"empty|resize|zeros|alloc|Alloc|detail::|TensorBase|make_tensor|clone|wrapper_|"
                   r"at::_ops::|redispatch|boxed|Boxed|c10::|torch::autograd::(?!generated)|std::|unwind")


def cpp_op(frames) -> str:
    """The innermost C++ frame that names an operator or kernel (with --stacks all): what the
    autograd engine and the kernels allocate has no Python frame of its own."""
    for f in frames or []:
        name = f.get("name", "")
        if ("at::native::" in name or "cudnn" in name.lower() or "fmha" in name or "mha_" in name
                or "torch::autograd::generated::" in name) and not _SKIP.search(name.split("(")[0]):
            return "C++ " + name.split("(")[0][:110]
    return ""


def anatomy(torch, transformers, row, stacks: str = "python") -> list[str]:
    from gpumon.estimate import Setup, estimate, load_config
    model, config = bench.build(torch, transformers, row)
    opt = bench.make_optimizer(torch, row, model.parameters())
    ids = torch.randint(0, config.vocab_size, (row.batch, row.seq), device="cuda")
    amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(row.dtype)

    def step():
        with torch.autocast("cuda", dtype=amp_dtype, enabled=row.amp):
            loss = model(input_ids=ids, labels=ids).loss if row.loss == "ce" else model(input_ids=ids).logits.mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start_alloc = torch.cuda.memory_allocated()
    start_req = torch.cuda.memory_stats().get("requested_bytes.all.current", start_alloc)
    torch.cuda.memory._record_memory_history(max_entries=5_000_000, stacks=stacks)
    step()
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    peak_alloc = torch.cuda.max_memory_allocated()
    peak_req = torch.cuda.memory_stats().get("requested_bytes.all.peak")
    live: dict[int, tuple[int, str]] = {}
    cur = best = 0
    best_live: dict[int, tuple[int, str]] = {}
    recent: deque = deque(maxlen=12)   # (address, (size, where)) of the allocations just before the peak
    best_recent: list = []
    for ev in snap["device_traces"][torch.cuda.current_device()]:
        a = ev["action"]
        if a == "alloc":
            live[ev["addr"]] = (ev["size"], where(ev.get("frames")))
            recent.append((ev["addr"], live[ev["addr"]]))
            cur += ev["size"]
            if cur > best:
                best, best_live, best_recent = cur, dict(live), list(recent)
        elif a == "free_completed" and ev["addr"] in live:
            cur -= live.pop(ev["addr"])[0]
    groups: dict[str, int] = defaultdict(int)
    for size, w in best_live.values():
        groups[w] += size
    arch, _ = load_config(bench.CONFIGS / f"{row.config}.json")
    e = estimate(Setup(arch=arch, batch=row.batch, seq=row.seq, dtype=row.dtype, amp=row.amp, optimizer=row.optimizer,
                       impl=row.impl, checkpointing=row.ckpt, attn=row.attn, loss=row.loss))
    p = sum(t.numel() * t.element_size() for t in model.parameters())
    st = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
             if torch.is_tensor(t) and t.is_cuda)
    out = [f"## {row.name}: {row.label()}", "",
           f"- max_memory_allocated {peak_alloc / MiB:.1f} MiB; requested peak {peak_req / MiB:.1f} MiB "
           f"(rounding {(peak_alloc - peak_req) / MiB:.1f} MiB); estimate {e.peak_bytes / MiB:.1f} MiB at {e.peak_moment}",
           f"- live before the step: {start_alloc / MiB:.1f} MiB allocated ({start_req / MiB:.1f} requested): parameters "
           f"{p / MiB:.1f}, optimizer state {st / MiB:.1f}, rest {(start_req - p - st) / MiB:.1f} (cuBLAS workspaces, buffers)",
           f"- allocated during the step and live at the requested peak: {best / MiB:.1f} MiB; by where:", ""]
    for w, b in sorted(groups.items(), key=lambda kv: -kv[1])[:20]:
        out.append(f"    {b / MiB:10.1f} MiB  {w}")
    out += ["", "- the last allocations up to the peak (oldest first; * = still live at the peak):", ""]
    for addr, (size, w) in best_recent:
        out.append(f"    {size / MiB:10.2f} MiB {'*' if addr in best_live else ' '} {w}")
    out += ["", "- the estimate's terms at its peak: " + ", ".join(
        f"{t.label} {t.at_peak / MiB:.1f}" for t in e.terms if t.at_peak), ""]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", action="append", required=True, help="a row name of estimate_accuracy.py (repeatable)")
    ap.add_argument("--stacks", choices=("python", "all"), default="python",
                    help="all: C++ frames too, to name the kernel that allocated (slower)")
    ap.add_argument("--out", help="also write the report here (markdown)")
    a = ap.parse_args(argv)
    import torch
    import transformers
    if not torch.cuda.is_available():
        print("needs CUDA", file=sys.stderr)
        return 2
    rows = [r for r in bench.ROWS if r.name in a.only]
    missing = set(a.only) - {r.name for r in rows}
    if missing:
        print(f"no such row: {', '.join(sorted(missing))}", file=sys.stderr)
        return 2
    lines = [f"# Peak anatomy ({torch.cuda.get_device_name(0)}, torch {torch.__version__}, "
             f"transformers {transformers.__version__})", ""]
    for r in rows:
        lines += anatomy(torch, transformers, r, a.stacks)
        torch.cuda.empty_cache()
        print("\n".join(lines[-30:]), flush=True)
    if a.out:
        Path(a.out).write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
