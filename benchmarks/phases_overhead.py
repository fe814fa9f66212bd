"""Overhead of gpumon's phase hooks on a training step (run by hand; writes a Markdown table).

    python benchmarks/phases_overhead.py [--device cuda|cpu] [--reps 9] [--steps 30]
                                         [--workload mlp|blog] [--batch N]
                                         [--out benchmarks/phases_overhead.md]

``--workload blog``: the blog's loop instead (a Qwen2.5-1.5B-shaped model from
tests/fixtures/configs, fp32 AdamW, sequence 256; ``--layers`` cuts the model for a CPU try),
where issue 35's target applies: every step's exact peak at <= 0.1% of step time.

The workload is Python-bound on purpose (FACTS.md: 24 x Linear(256)+LayerNorm+GELU, AdamW, small
batch): there every microsecond a hook adds shows. Modes, interleaved rep by rep so drift in the
machine's speed hits them all alike:

* ``off``: no hooks.
* ``phases``: gpumon's PhaseTracker as the agent installs it (optimizer step hooks, one global
  pre-hook armed only between root calls (hooks.py), backward start/end detection, and on CUDA
  at every phase boundary of every step torch's peak counters read and reset, the program's
  view kept (counters.py); rate-limited breakdowns by role, and the allocation history read and
  replayed for one step in N for the roles at the peak (PHASES_BUDGET)).
* ``global hooks``: for comparison, two trivial global module hooks left on for every module call
  (what FACTS.md measured, ~10% on such loops; gpumon's own is out of the dict inside a root call).

Reported: the median step time per mode, the median of the per-rep ratios to ``off`` and their
range (the spread says how far the figure can be trusted on this machine), the tracker's own
time as it accounts it (what its budget holds to PHASES_BUDGET), what an exactly measured step
costs, and the cost of one breakdown walk.
"""
from __future__ import annotations

import argparse
import gc
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.append(str(ROOT / "benchmarks"))  # blog_model (when run as a module too)


def build(torch, device: str, layers: int, width: int):
    blocks = []
    for _ in range(layers):
        blocks += [torch.nn.Linear(width, width), torch.nn.LayerNorm(width), torch.nn.GELU()]
    model = torch.nn.Sequential(*blocks).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return model, opt


def build_blog(torch, device: str, batch: int, layers: int | None):
    from blog_model import build
    model, config = build(torch, device, layers=layers)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    ids = torch.randint(0, config.vocab_size, (batch, 256), device=device)
    return model, opt, ids


def make_tracker(torch, device: str, events: list):
    """(tracker, devices, memory, history) as the agent makes them (gpumon/agent/phases/
    __init__.py: on CUDA the counters are installed at the first boundary); events collected."""
    from gpumon.agent.phases import NoMemory, PhaseTracker, TorchHistory
    from gpumon.agent.phases.counters import PeakCounters
    from gpumon.agent.phases.tracker import PHASES_BUDGET
    if device == "cuda":
        memory, devices = PeakCounters(torch._C, torch_mod=torch), (
            lambda: [torch.cuda.current_device()])
        history = TorchHistory(torch)
    else:
        memory, devices, history = NoMemory(), (lambda: ["cpu"]), None
    tracker = PhaseTracker(torch, lambda k, p: events.append((k, p)), devices, memory,
                           budget=PHASES_BUDGET, history=history)
    return tracker, devices, memory, history


def median_ci(ratios: list, level: float = 0.9, n: int = 4000) -> tuple[float, float]:
    """A bootstrap confidence interval of the median of the per-repetition ratios (seeded:
    the same figures give the same interval)."""
    import random
    rng = random.Random(0)
    k = len(ratios)
    meds = sorted(statistics.median(rng.choices(ratios, k=k)) for _ in range(n))
    lo = meds[int((1 - level) / 2 * n)]
    hi = meds[min(n - 1, int((1 + level) / 2 * n))]
    return lo, hi


def ratio_row(mode: str, t: list, off: list) -> str:
    """A table row: the median step, the median of the per-repetition ratios to ``off`` (each
    repetition's modes ran back to back), its 90% bootstrap interval and the ratios' range."""
    if mode == "off":
        return f"| off | {1000 * statistics.median(t):.3f} ms | - | - | - |"
    ratios = [a / o - 1 for a, o in zip(t, off)]
    lo, hi = median_ci(ratios)
    return (f"| {mode} | {1000 * statistics.median(t):.3f} ms | "
            f"{100 * statistics.median(ratios):+.3f}% | {100 * lo:+.3f}% .. {100 * hi:+.3f}% | "
            f"{100 * min(ratios):+.2f}% .. {100 * max(ratios):+.2f}% |")


TABLE_HEAD = ["| mode | median step | median vs off | its 90% interval | range over repetitions |",
              "|---|---|---|---|---|"]
TABLE_HEAD_QUIET = ["", "Every step's exact peak alone (issue 35's target): the repetitions in "
                    "which the tracker replayed no step and broke nothing down by role:", ""] + TABLE_HEAD
QUIET_NOTE = ["", "The replay (roles at the peak moment) and the breakdowns by role run on their "
              "own budgets (one step in N; at most 0.02% of wall time): the first table holds "
              "them where they fell, these rows the rest."]


class FullCollections:
    """Python's full (generation 2) collections while each mode ran: how many and how long.
    In a process holding transformers (~350k objects) one takes 0.2-0.3 s of the training
    thread; where the loop waits for the GPU every step (the Trainer's NaN check) it shows whole
    in the chunk it hits. Rare (on CPU a Trainer made one in 1,500 steps), but one is a 5-20%
    outlier in a 4-step chunk. The count per mode is also the tracker's own part in them."""

    def __init__(self) -> None:
        self.mode: str | None = None
        self.by_mode: dict = {}
        self._t0: float | None = None
        gc.callbacks.append(self)

    def __call__(self, phase: str, info: dict) -> None:
        if info.get("generation") != 2:
            return
        if phase == "start":
            self._t0 = time.perf_counter()
        elif self._t0 is not None and self.mode is not None:
            n, t = self.by_mode.get(self.mode, (0, 0.0))
            self.by_mode[self.mode] = (n + 1, t + time.perf_counter() - self._t0)
            self._t0 = None

    def line(self, modes, steps: dict, frozen: bool) -> str:
        parts = []
        for m in modes:
            n, t = self.by_mode.get(m, (0, 0.0))
            parts.append(f"{m} {n} ({1000 * t:.0f} ms over {steps[m]} steps)")
        how = ("the objects alive after the warm-up frozen (`gc.freeze()`, `--gc-freeze`): a "
               "full collection walks only what the run made since, in both modes alike"
               if frozen else "not frozen (`--gc-freeze` leaves the warm-up's objects out "
               "of them)")
        return f"Python's full collections during the reps, {how}: " + "; ".join(parts) + "."


def calibration_mode(us: int) -> str | None:
    return f"{us} us spin" if us > 0 else None


def spinner(us: int):
    """A root forward pre-hook that keeps the training thread busy for ``us`` microseconds:
    a known CPU cost at the point a step's launches start (after the last step's sync, if any)."""
    def spin(module, args):
        t_end = time.perf_counter() + us / 1e6
        while time.perf_counter() < t_end:
            pass
    return spin


def calibration_line(spin: str, us: int, times: dict) -> str:
    """What the calibration mode says about the others: if a known CPU cost per step shows
    fully, the loop is bound by its training thread and the tracker's own time is its price; if
    it hardly shows, the GPU is the bound and CPU work in the hooks hides behind its queue."""
    off, cal = times["off"], times[spin]
    d = statistics.median(c - o for c, o in zip(cal, off))
    return (f"Calibration: {us} us of CPU spin at each root forward's start moved the median "
            f"step by {1e6 * d:+.0f} us ({100 * d / statistics.median(off):+.3f}%): "
            f"{'the step is bound by the training thread: its CPU time shows whole' if d > 0.6e-6 * us else 'CPU time in the training thread largely hides behind the GPU here' }"
            f" (the measurement's own spread is the ranges above).")


def busy(events: list, lo: int) -> int:
    """The tracker's occasional work in ``events[lo:]``: replayed steps and breakdowns by role
    (each ms long, on their own budgets), apart from what every step pays."""
    return sum(1 for k, p in events[lo:] if k == "breakdown" or (k == "step" and p.get("replayed")))


def quiet_rows(modes, times: dict, medians: dict | None, quiet: dict) -> list[str]:
    """The modes' rows again over the repetitions where the tracker replayed no step and broke
    nothing down (each against the same repetition's ``off``): the price of every step's exact
    peak alone, issue 35's target; the full rows above include the replay and breakdowns at
    their budgets."""
    out = []
    for m in modes:
        q = quiet.get(m)
        if m == "off" or not q or all(q):
            continue
        keep = [i for i, ok in enumerate(q) if ok]
        if len(keep) < 3:
            continue
        label = f"{m}, the {len(keep)} of {len(q)} reps with no replay or breakdown"
        for name, table in (("", times), (", chunk's median step", medians)):
            if table is None:
                continue
            t = [table[m][i] for i in keep]
            off = [table["off"][i] for i in keep]
            out.append(ratio_row(m, t, off).replace(f"| {m} |", f"| {label}{name} |", 1))
    return out


def own_plain_line(plain: list, n_bound: int, tracker) -> str:
    """What the steps the replay skipped cost the tracker, from its own accounting (every
    step's cost is summed into cost_total; the replayed steps' share is known apart). Against
    the median step time: a step's time_s runs from the close before, so the first step after a
    mode change spans the other mode's whole repetition (the mean would hide the cost)."""
    if not plain:
        return "no unreplayed step."
    t = statistics.median(p["time_s"] for p in plain)
    c = sum(p.get("cost_us", 0) for p in plain) / 1e6 / len(plain)
    return (f"{len(plain)} steps, median {1000 * t:.1f} ms, {n_bound / len(plain):.1f} "
            f"boundaries a step; the tracker's own time {1e6 * c:.0f} us a step (mean), "
            f"{1e6 * c * len(plain) / max(n_bound, 1):.1f} us a boundary: {100 * c / t:.3f}% of "
            "the median step (target 0.1%). Per step: median "
            f"{statistics.median(p.get('cost_us', 0) for p in plain)} us, max "
            f"{max(p.get('cost_us', 0) for p in plain)} us.")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    ap.add_argument("--reps", type=int, default=9, help="interleaved repetitions per mode")
    ap.add_argument("--steps", type=int, default=30, help="timed steps per repetition")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--batch", type=int, default=None, help="default: 32 (mlp), 2 (blog)")
    ap.add_argument("--workload", choices=("mlp", "blog", "trainer"), default="mlp")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "phases_overhead.md"))
    ap.add_argument("--item", action="store_true",
                    help="blog: read loss.item() at every step's end, as a loop that logs its "
                         "loss does (the next step's first boundary then runs on an idle GPU)")
    ap.add_argument("--calibrate-us", type=int, default=500,
                    help="a calibration mode: this many us of CPU spin at each root forward's "
                         "start (what a cost in the training thread at its most exposed point "
                         "does to the step; 0: no such mode)")
    ap.add_argument("--gc-freeze", action="store_true",
                    help="gc.freeze() after the warm-up, in every mode alike: Python's full "
                         "collections then skip the model's and libraries' objects (one takes "
                         "0.2-0.3 s of the training thread otherwise, an outlier chunk where "
                         "the loop syncs every step); their count per mode is reported")
    args = ap.parse_args(argv)

    import torch
    import torch.nn.modules.module as mm

    from gpumon.agent.phases import PhaseTracker
    from gpumon.agent.phases.counters import PeakCounters
    from gpumon.agent.phases.tracker import BREAKDOWN_SHARE, PHASES_BUDGET

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    if args.workload == "trainer":
        return trainer_main(args, torch, device)
    if args.workload == "blog":
        batch = args.batch or 2
        model, opt, ids = build_blog(torch, device, batch, args.layers if args.layers != 24
                                     else None)

        def step():
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if args.item:
                loss.item()  # a loop that logs its loss: the GPU drains at every step's end
        workload = (f"the blog's loop: Qwen2.5-1.5B shape"
                    f"{'' if args.layers == 24 else f' cut to {args.layers} layers'}, fp32 "
                    f"AdamW, batch {batch}, sequence 256"
                    f"{', loss.item() at every step end' if args.item else ''}")
        modes = ("off", "phases")
    else:
        batch = args.batch or 32
        model, opt = build(torch, device, args.layers, args.width)
        x = torch.randn(batch, args.width, device=device)

        def step():
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        workload = (f"{args.layers} x (Linear({args.width}) + LayerNorm + GELU), batch {batch}, "
                    "AdamW (a Python-bound step: the worst case for hooks)")
        modes = ("off", "phases", "global hooks")
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    events: list = []
    tracker, devices, memory, history = make_tracker(torch, device, events)

    def nop_pre(m, a):
        return None

    def nop_post(m, a, o):
        return None

    state = {"globals": []}
    spin = calibration_mode(args.calibrate_us)
    if spin:
        modes = modes + (spin,)

    def enter(mode: str) -> None:
        if mode == "phases":
            tracker.install_hooks()
            step()  # the first step (a new root seen): untimed, as in a real run
        elif mode == "global hooks":
            state["globals"] = [mm.register_module_forward_pre_hook(nop_pre),
                                mm.register_module_forward_hook(nop_post)]
        elif mode == spin:
            state["globals"] = [model.register_forward_pre_hook(spinner(args.calibrate_us))]

    def leave(mode: str) -> None:
        if mode == "phases":
            tracker.close()
        elif mode in ("global hooks", spin):
            for h in state["globals"]:
                h.remove()

    medians: dict[str, list[float]] = {m: [] for m in modes}
    quiet: dict[str, list[bool]] = {m: [] for m in modes}

    def timed(n: int, mode: str) -> float:
        n_ev = len(events)
        sync()
        t0 = time.perf_counter()
        stamps = [t0]
        for _ in range(n):
            step()
            stamps.append(time.perf_counter())  # with --item each step ends in a sync
        sync()
        t1 = time.perf_counter()
        stamps[-1] = t1
        medians[mode].append(statistics.median(b - a for a, b in zip(stamps, stamps[1:])))
        quiet[mode].append(busy(events, n_ev) == 0)
        return (t1 - t0) / n

    for _ in range(5 if args.workload == "mlp" else 2):  # allocator, kernels, optimizer state
        step()
    # the tracker's first steps (every boundary broken down by role, the first steps replayed)
    # happen once in a run: untimed here, so the reps time what every later step pays
    enter("phases")
    for _ in range(tracker._warm_steps + 2):
        step()
    leave("phases")
    sync()
    if args.gc_freeze:
        gc.collect()
        gc.freeze()
    full = FullCollections()
    times: dict[str, list[float]] = {m: [] for m in modes}
    t_start = time.perf_counter()
    for rep in range(args.reps):
        order = modes if rep % 2 == 0 else tuple(reversed(modes))
        for mode in order:
            full.mode = mode
            enter(mode)
            times[mode].append(timed(args.steps, mode))
            leave(mode)
            full.mode = None
    wall = time.perf_counter() - t_start

    bds = [p for k, p in events if k == "breakdown"]
    steps_seen = [p for k, p in events if k == "step"]
    cost = statistics.median([p["cost_us"] for p in bds]) if bds else None
    exact = [p for p in steps_seen if p["peak_exact"]]
    replayed = [p for p in steps_seen if p.get("replayed")]
    own = tracker.cost_total / tracker.time_total if tracker.time_total else None
    counters = getattr(tracker.counters, "status", lambda: None)()
    # the unreplayed steps alone: what every step pays (hooks, boundary reads and resets)
    plain = [p for p in steps_seen if not p.get("replayed")]
    n_bound = sum(len(p["boundaries"]) for p in plain)
    # one exactly measured step's own cost, measured apart (budget 0: every step measured)
    probe = PhaseTracker(torch, lambda k, p: None, devices,
                         PeakCounters(torch._C, torch_mod=torch) if device == "cuda" else memory,
                         budget=None, history=history)
    probe.install_hooks()
    for _ in range(3):
        step()
    c0, t0 = probe.cost_total, probe.time_total
    for _ in range(10):
        step()
    probe.close()
    per_step = (probe.cost_total - c0) / 10
    per_step_frac = (probe.cost_total - c0) / max(probe.time_total - t0, 1e-9)

    dev_name = torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu"
    lines = [
        "# Overhead of gpumon's phase hooks",
        "",
        f"Written by `python benchmarks/phases_overhead.py` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.",
        f"Device: {device} ({dev_name}); torch {torch.__version__}; Python {platform.python_version()}.",
        f"Workload: {workload}. {args.reps} interleaved "
        f"repetitions x {args.steps} timed steps per mode; {wall:.0f} s in all.",
        "",
    ] + TABLE_HEAD + [ratio_row(mode, times[mode], times["off"]) for mode in modes]
    if args.item:  # each step ends in a sync: its own time is known
        lines += [ratio_row(m, medians[m], medians["off"]).replace(
            f"| {m} |", f"| {m}, chunk's median step |", 1) for m in modes if m != "off"] + [
            "", "The last rows: each repetition's median step instead of its mean (the loop "
            "waits for the GPU at every step's end, so each step's time is known; one slow "
            "step then moves nothing)."]
    q_rows = quiet_rows(modes, times, medians if args.item else None, quiet)
    if q_rows:
        lines += TABLE_HEAD_QUIET + q_rows + QUIET_NOTE
    if spin:
        lines += ["", calibration_line(spin, args.calibrate_us, times)]
    lines += ["", full.line(modes, {m: args.steps * args.reps + (m == "phases") * args.reps
                                    for m in modes}, args.gc_freeze)]
    lines += [
        "",
        f"The tracker's own time as it accounts it (hooks' bookkeeping, allocator reads, history "
        f"reads and replays, role walks): {100 * own:.3f}% of the loop's time in the phases mode "
        f"(its budget: {100 * PHASES_BUDGET:g}%); it reported {len(steps_seen)} of "
        f"{tracker.steps_done} steps, {len(exact)} of them exact (torch's peak counters: "
        f"{counters}; forward starts with only the counters' read-reset-read there: "
        f"{getattr(tracker, 'early_starts', 0)}), and replayed {len(replayed)} (one in "
        f"{tracker.every} at the end). "
        f"A replayed step costs it {per_step * 1000:.2f} ms ({100 * per_step_frac:.1f}% of such "
        "a step, every step replayed)." if own is not None else "",
        "",
        f"Every step, replayed or not (the hooks' bookkeeping and, on CUDA, the counters read "
        f"and reset at each boundary): {own_plain_line(plain, n_bound, tracker)}",
        "",
        f"Breakdowns by role: {len(bds)} over {len(steps_seen)} steps counted by the tracker; "
        f"one costs {cost} us (median; walks {bds[-1]['tensors'] if bds else 0} tensors). They run "
        "at every phase boundary of the first 3 steps, when a new peak is set, and otherwise at "
        f"most once a second and within {100 * BREAKDOWN_SHARE:.2g}% of wall time (BREAKDOWN_SHARE).",
        "",
        "Reading it: the phases row is the price of gpumon's hooks; a range that straddles 0 means "
        "the cost is inside this machine's noise. The global-hooks row shows why gpumon's global "
        "hook leaves the dict while a root forward runs.",
    ]
    text = "\n".join(lines) + "\n"
    Path(args.out).write_text(text)
    print(text)
    return 0


def trainer_main(args, torch, device: str) -> int:
    """The blog's model trained by a Hugging Face Trainer (its own loop, accelerate's backward and
    optimizer wrapper, the scheduler, callbacks): one run whose steps go in chunks, the tracker
    installed for every other chunk (``phases``) and closed for the rest (``off``), interleaved as
    the other workloads' reps are. A chunk's first step is untimed (a mode change); its others are
    timed from a synchronize to a synchronize."""
    import tempfile

    import transformers
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from blog_model import build as build_model

    transformers.logging.set_verbosity_error()
    batch = args.batch or 2
    model, config = build_model(torch, device, layers=args.layers if args.layers != 24 else None)
    seq = 256

    class Tokens(torch.utils.data.Dataset):
        def __init__(self, n: int) -> None:
            self.n = n

        def __len__(self):
            return self.n

        def __getitem__(self, i):
            g = torch.Generator().manual_seed(i)
            ids = torch.randint(0, config.vocab_size, (seq,), generator=g)
            return {"input_ids": ids, "labels": ids}

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    events: list = []
    tracker, devices, memory, history = make_tracker(torch, device, events)
    spin = calibration_mode(args.calibrate_us)
    modes = ("off", "phases") + ((spin,) if spin else ())
    # the tracker's first steps (every boundary broken down, the first steps replayed) happen
    # once in a run: an untimed chunk first, so the reps time what every later step pays
    plan = ["warm"]
    for rep in range(args.reps):
        plan += list(modes if rep % 2 == 0 else reversed(modes))
    times: dict = {m: [] for m in modes + ("warm",)}
    medians: dict = {m: [] for m in modes + ("warm",)}
    full = FullCollections()
    spin_hooks: list = []
    state = {"chunk": -1, "n": 0, "t0": 0.0, "warm": 2, "ev": 0}
    quiet: dict = {m: [] for m in modes + ("warm",)}

    class Chunks(TrainerCallback):
        def on_step_end(self, a, st, control, **kw):
            if state["warm"] > 0:  # allocator, kernels, optimizer state
                state["warm"] -= 1
                if state["warm"] == 0:
                    if args.gc_freeze:
                        gc.collect()
                        gc.freeze()
                    self._next()
                return control
            state["n"] += 1
            if state["n"] == 1:
                sync()
                state["ev"] = len(events)
                state["t0"] = time.perf_counter()
                state["stamps"] = [state["t0"]]
            elif state["n"] <= 1 + args.steps:
                # no sync between: the Trainer's isnan(loss) check waits for the GPU once a
                # step, so each interval is one step's wall time (a chunk's median step is
                # then robust to one slow step)
                state["stamps"].append(time.perf_counter())
            if state["n"] == 1 + args.steps:
                sync()
                mode = plan[state["chunk"]]
                now = time.perf_counter()
                times[mode].append((now - state["t0"]) / args.steps)
                stamps = state["stamps"][:-1] + [now]  # the last step ends at the sync
                medians[mode].append(statistics.median(b - a for a, b in zip(stamps, stamps[1:])))
                quiet[mode].append(busy(events, state["ev"]) == 0)
                if mode in ("phases", "warm"):
                    tracker.close()
                while spin_hooks:
                    spin_hooks.pop().remove()
                self._next()
            if state["chunk"] >= len(plan):
                control.should_training_stop = True
            return control

        def _next(self):
            state["chunk"] += 1
            state["n"] = 0
            mode = plan[state["chunk"]] if state["chunk"] < len(plan) else None
            full.mode = mode
            if mode in ("phases", "warm"):
                tracker.install_hooks()
            elif mode == spin:
                spin_hooks.append(model.register_forward_pre_hook(spinner(args.calibrate_us)))

    total = 2 + len(plan) * (1 + args.steps) + 1
    with tempfile.TemporaryDirectory() as out:
        targs = TrainingArguments(
            output_dir=out, per_device_train_batch_size=batch, max_steps=total,
            learning_rate=1e-5, optim="adamw_torch", logging_strategy="no",
            save_strategy="no", report_to=[], dataloader_num_workers=0,
            use_cpu=device != "cuda", disable_tqdm=True)
        t_start = time.perf_counter()
        Trainer(model=model, args=targs, train_dataset=Tokens(total * batch),
                callbacks=[Chunks()]).train()
        wall = time.perf_counter() - t_start
    off = times["off"]
    steps_seen = [p for k, p in events if k == "step"]
    exact = [p for p in steps_seen if p["peak_exact"]]
    plain = [p for p in steps_seen if not p.get("replayed")]
    n_bound = sum(len(p["boundaries"]) for p in plain)
    counters = getattr(tracker.counters, "status", lambda: None)()
    q_rows = quiet_rows(modes, times, medians, quiet)
    dev_name = torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu"
    lines = [
        "# Overhead of gpumon's phase hooks: a Hugging Face Trainer run",
        "",
        f"Written by `python benchmarks/phases_overhead.py --workload trainer` on "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.",
        f"Device: {device} ({dev_name}); torch {torch.__version__}; transformers "
        f"{transformers.__version__}; Python {platform.python_version()}.",
        f"Workload: the blog's model (Qwen2.5-1.5B shape"
        f"{'' if args.layers == 24 else f' cut to {args.layers} layers'}, fp32 AdamW, batch "
        f"{batch}, sequence {seq}) trained by `Trainer.train()`; one run of {total} steps in "
        f"{len(plan)} chunks of {args.steps} timed steps, the tracker installed for every other "
        f"chunk ({args.reps} interleaved repetitions per mode); {wall:.0f} s in all.",
        "",
    ] + TABLE_HEAD + [ratio_row(m, times[m], off) for m in modes] + [
        ratio_row(m, medians[m], medians["off"]).replace(f"| {m} |", f"| {m}, chunk's median step |", 1)
        for m in modes if m != "off"] + [
        "", "The last rows: each chunk's median step instead of its mean (the Trainer waits for "
        "the GPU once a step, so each step's time is known; one slow step then moves nothing)."] + (
        (TABLE_HEAD_QUIET + q_rows + QUIET_NOTE) if q_rows else []) + (
        ["", calibration_line(spin, args.calibrate_us, times)] if spin else []) + [
        "", full.line(modes, {m: (args.steps + 1) * args.reps for m in modes}, args.gc_freeze),
        "",
        f"Steps the tracker reported: {len(steps_seen)}, {len(exact)} of them exact (torch's "
        f"peak counters: {counters}; forward starts with only the counters' read-reset-read "
        f"there: {getattr(tracker, 'early_starts', 0)}); phases of the last: "
        f"{sorted(steps_seen[-1]['phases']) if steps_seen else None}.",
        "",
        f"Every step (the hooks' bookkeeping and, on CUDA, the counters read and reset at each "
        f"boundary): {own_plain_line(plain, n_bound, tracker)}",
    ]
    text = "\n".join(lines) + "\n"
    Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
