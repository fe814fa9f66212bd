"""A torch.compile'd small transformer trained plainly and under `gpumon run`: the same graphs
(count, breaks, recompiles), the same losses, and the step time side by side.

    python benchmarks/compat_gpu.py [--device cuda|cpu] [--reps 9] [--steps 20]
                                    [--backend inductor] [--out benchmarks/compat_gpu.md]

Two worker processes (this file with --worker), one plain and one started by `gpumon run`
(agent, sampler and phase hooks as a user gets them), compile at the same time, then take turns:
repetition by repetition each times --steps steps while the other waits, the order alternating,
so drift in the machine's speed hits both alike. Reported: graphs and breaks of each, the
median step time of each, the median of the per-repetition ratios and their range (the spread
says how far the figure can be trusted), and what gpumon saw of the steps. ``--device cpu``
(default backend there: aot_eager) runs the whole thing on a machine without a GPU.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------- the worker
def worker(args: argparse.Namespace) -> int:
    import torch
    import torch.nn.functional as F
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    dev = args.device
    D, H, L, V, T = args.width, 8, args.layers, 1024, args.seq

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln1, self.ln2 = torch.nn.LayerNorm(D), torch.nn.LayerNorm(D)
            self.qkv, self.proj = torch.nn.Linear(D, 3 * D), torch.nn.Linear(D, D)
            self.fc, self.out = torch.nn.Linear(D, 4 * D), torch.nn.Linear(4 * D, D)

        def forward(self, x):
            B, S, _ = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(B, S, 3, H, D // H).transpose(1, 3).unbind(2)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(a.transpose(1, 2).reshape(B, S, D))
            return x + self.out(F.gelu(self.fc(self.ln2(x))))

    class GPT(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(V, D)
            self.blocks = torch.nn.ModuleList(Block() for _ in range(L))
            self.head = torch.nn.Linear(D, V)

        def forward(self, idx):
            x = self.emb(idx)
            for b in self.blocks:
                x = b(x)
            return self.head(x)

    model = GPT().to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    cmodel = torch.compile(model, backend=args.backend)
    g = torch.Generator(device="cpu").manual_seed(1)
    data = [torch.randint(0, V, (args.batch, T + 1), generator=g).to(dev) for _ in range(4)]
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    losses: list[str] = []

    def step(i: int) -> None:
        d = data[i % len(data)]
        logits = cmodel(d[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, V), d[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if len(losses) < 8:
            losses.append(loss.item().hex())

    t0 = time.perf_counter()
    for i in range(args.warm):
        step(i)
    sync()
    out = sys.stdout

    def say(obj: dict) -> None:
        out.write(json.dumps(obj) + "\n")
        out.flush()

    say({"ready": round(time.perf_counter() - t0, 2)})
    n = args.warm
    for line in sys.stdin:
        cmd = line.split()
        if not cmd or cmd[0] == "quit":
            break
        k = int(cmd[1])
        times = []
        for _ in range(k):
            sync()
            t = time.perf_counter()
            step(n)
            sync()
            times.append(time.perf_counter() - t)
            n += 1
        say({"times": times})
    seen = None
    P = sys.modules.get("gpumon.agent.phases")
    tr = getattr(P, "_tracker", None) if P is not None else None
    if tr is not None:
        with tr._lock:
            tr._maybe_close_step()
        st = tr.status()
        seen = {"steps_done": st["steps_done"], "roots": st["roots"], "note": st["note"],
                "recent": [(s["forwards"], s["backwards"], sorted(s["phases"]))
                           for s in st["recent_steps"][-3:]]}
    say({"graphs": counters["stats"].get("unique_graphs", 0),
         "breaks": sum(counters["graph_break"].values()),
         "recompiles": sum(v for k, v in counters["recompiles"].items()) if "recompiles" in counters
         else 0, "losses": losses, "gpumon": "gpumon" in sys.modules, "phases": seen})
    return 0


# ---------------------------------------------------------------------- the parent
class Worker:
    def __init__(self, mode: str, args: argparse.Namespace) -> None:
        self.mode = mode
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--device", args.device,
               "--backend", args.backend, "--layers", str(args.layers), "--width", str(args.width),
               "--batch", str(args.batch), "--seq", str(args.seq), "--warm", str(args.warm)]
        env = {k: v for k, v in os.environ.items() if not k.startswith("GPUMON")}
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [
            p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
        if mode == "gpumon":
            if args.device != "cuda":
                env["GPUMON_SOURCE"] = "simulated"
                env["GPUMON_SIM_READY"] = "now"
            cmd = [sys.executable, "-m", "gpumon", "run", "--", *cmd]
        self.p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, env=env, cwd=str(ROOT))

    def read(self) -> dict:
        line = self.p.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.mode} worker ended: {self.p.stderr.read()[-3000:]}")
        return json.loads(line)

    def send(self, s: str) -> None:
        self.p.stdin.write(s + "\n")
        self.p.stdin.flush()

    def finish(self) -> dict:
        self.send("quit")
        res = self.read()
        self.p.stdin.close()
        self.stderr = self.p.stderr.read()
        self.p.wait(60)
        return res


def measure(args: argparse.Namespace) -> dict:
    t0 = time.perf_counter()
    ws = {m: Worker(m, args) for m in ("plain", "gpumon")}  # compile at the same time
    ready = {m: w.read()["ready"] for m, w in ws.items()}
    per_rep: dict[str, list[float]] = {m: [] for m in ws}
    spread: dict[str, list[float]] = {m: [] for m in ws}
    for rep in range(args.reps):
        order = ("plain", "gpumon") if rep % 2 == 0 else ("gpumon", "plain")
        for m in order:
            ws[m].send(f"run {args.steps}")
            t = ws[m].read()["times"]
            per_rep[m].append(statistics.median(t))
            spread[m].append((max(t) - min(t)) / statistics.median(t))
    final = {m: w.finish() for m, w in ws.items()}
    ratios = [g / p - 1 for g, p in zip(per_rep["gpumon"], per_rep["plain"])]
    return {"ready_s": ready, "per_rep": per_rep, "ratios": ratios,
            "median_ratio": statistics.median(ratios), "final": final,
            "stderr": {m: w.stderr[-2000:] for m, w in ws.items()},
            "wall_s": time.perf_counter() - t0}


def report(args: argparse.Namespace, r: dict, device_name: str, torch_version: str) -> str:
    f = r["final"]
    lines = [
        "# torch.compile'd transformer: plain vs under `gpumon run`", "",
        f"Written by `python benchmarks/compat_gpu.py` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.",
        f"Device: {args.device} ({device_name}); torch {torch_version}; Python {platform.python_version()}.",
        f"Model: GPT-like, {args.layers} layers, width {args.width}, batch {args.batch} x {args.seq} "
        f"tokens, AdamW; `torch.compile(model, backend={args.backend!r})`; {args.warm} warm-up "
        f"steps (compile), then {args.reps} interleaved repetitions x {args.steps} timed steps "
        f"per mode; {r['wall_s']:.0f} s in all.", "",
        "| mode | graphs | graph breaks | recompiles | median step | first losses equal |",
        "|---|---|---|---|---|---|"]
    same = f["plain"]["losses"] == f["gpumon"]["losses"]
    for m in ("plain", "gpumon"):
        lines.append(f"| {m} | {f[m]['graphs']} | {f[m]['breaks']} | {f[m]['recompiles']} | "
                     f"{statistics.median(r['per_rep'][m]) * 1000:.3f} ms | {same} |")
    rs = r["ratios"]
    lines += ["", f"Step time under gpumon vs plain: median of the per-repetition ratios "
              f"{100 * r['median_ratio']:+.2f}% (range {100 * min(rs):+.2f}% .. "
              f"{100 * max(rs):+.2f}% over {len(rs)} repetitions).", "",
              f"What gpumon saw: {json.dumps(f['gpumon']['phases'])}", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    ap.add_argument("--backend", default=None, help="dynamo backend (default: inductor on "
                    "cuda, aot_eager on cpu)")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warm", type=int, default=5)
    # a small model, but a step of tens of ms on an H100 as real training has: the tracker's
    # fixed per-step bookkeeping (~0.1-0.2 ms: boundary reads, root and backward hooks) is ~3% of
    # a 7 ms Python-bound step (benchmarks/phases_overhead.md), well under 1% here
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "compat_gpu.md"))
    ap.add_argument("--json", default=None, help="also write the raw figures here")
    args = ap.parse_args(argv)
    if args.device is None or (args.backend is None and not args.worker):
        import torch
        args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.backend = args.backend or ("inductor" if args.device == "cuda" else "aot_eager")
    if args.worker:
        return worker(args)
    import torch
    name = torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "cpu"
    r = measure(args)
    text = report(args, r, name, torch.__version__)
    print(text)
    out = Path(args.out)
    prev = out.read_text() if out.exists() else ""
    head = "# Compatibility on the GPU\n\n"
    body = prev[len(head):] if prev.startswith(head) else prev
    out.write_text(head + text.replace("# ", "## ", 1) + "\n" + body)
    if args.json:
        Path(args.json).write_text(json.dumps(r, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
