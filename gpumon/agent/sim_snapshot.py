"""The simulated source's memory snapshot: its own script (sources.py _SimDevice.roles) replayed
through synth.py's caching-allocator model over the real recording window, so the file tells the
story the live view told: the same allocated bytes (parameters, gradients, optimizer state,
activations), the same steps, at the same (unix microsecond) times.

The script is sampled on a grid of points per phase (its kinks are grid points: the backward's
1/1.2, the optimizer's 0.5 and 0.8), and at each point the allocator is brought to the script's
bytes per role: frees first (newest tensor first, as autograd frees the last layer's
activations first), then allocations. Allocated bytes at every grid point are the script's
(within SLACK per role), so the trace's peak is the script's step peak. What was live before the
recording started is allocated unrecorded: it shows in the file as torch shows it, as blocks with
no stack ("allocated before recording started"). Standard library only; no torch.
"""
from __future__ import annotations

from typing import Any

# grid points per phase (x = i / n, i = 0..n), chosen so the script's kinks fall on them
GRID = {"data": 1, "forward": 12, "backward": 12, "optimizer": 10, "zero_grad": 10}
# a role within this many bytes of its target is left alone (the script's int() roundings)
SLACK = 4096
# events per step at least (to bound the replay of a long recording to the ring it keeps)
MIN_EVENTS_PER_STEP = 60


def _frames(role: str, layer: int) -> list:
    fn = {"parameters": ("model.py", 20 + layer, "__init__"),
          "optimizer_state": ("train.py", 64, "step"),
          "gradients": ("train.py", 61, "backward"),
          "batch": ("train.py", 55, "main"),
          "activations": ("model.py", 40 + layer, f"Block{layer}.forward"),
          "tmp": ("train.py", 64, "_multi_tensor_adamw")}[role]
    return [{"filename": "<simulated>/" + fn[0], "line": fn[1], "name": fn[2]},
            {"filename": "<simulated>/train.py", "line": 88, "name": "main"}]


def _targets(dev: Any, step: int, phase: str, x: float) -> dict[str, int]:
    """The script's bytes per role at (step, phase, x), activations split into the data batch,
    the model's activations and the optimizer's foreach temporary (each its own tensors)."""
    r = dev.roles(step, phase, x)
    act = r.pop("activations")
    if phase == "optimizer":
        r.update(batch=0, activations=0, tmp=act)
    else:
        batch = min(act, dev.BATCH)
        r.update(batch=batch, activations=act - batch, tmp=0)
    return r


class _Replay:
    """One device's allocator and the tensors each role holds (newest last)."""

    ROLES = ("parameters", "optimizer_state", "gradients", "batch", "activations", "tmp")

    def __init__(self, dev: Any, capacity: int, layers: int = 6) -> None:
        from gpumon.snapshot.synth import SynthAllocator
        self.dev = dev
        self.al = SynthAllocator(capacity, device=dev.index, tick=False)
        self.al.t = 0
        self.held: dict[str, list[tuple[int, int]]] = {r: [] for r in self.ROLES}
        self.layers = layers
        P = dev.src.params
        # the largest tensor each role allocates in one go: a layer's weights, an AdamW state
        # tensor per layer's weights, a forward grid step's activations of the steps' mean
        # size (the script's sizes wobble from step to step: tensors of a step's own size
        # would fit no cached block of a smaller step, and reserved memory would grow without
        # end where the source's own figures level off); other roles follow the grid's steps
        self.piece = {"parameters": -(-P // layers), "optimizer_state": -(-P // layers),
                      "activations": -(-dev.src.act // GRID["forward"])}
        self.frames = {(r, k): _frames(r, k) for r in self.ROLES for k in range(layers)}

    def live(self, role: str) -> int:
        return sum(s for _, s in self.held[role])

    def to(self, targets: dict[str, int], layer: int) -> None:
        al, grow = self.al, []
        for role in self.ROLES:
            want, have, held = targets[role], self.live(role), self.held[role]
            if abs(want - have) <= SLACK:
                continue
            while held and have > want + SLACK:
                addr, size = held.pop()
                al.free(addr)
                have -= size
            if want - have > SLACK:
                grow.append((role, want - have))
        for role, need in grow:
            held = self.held[role]
            piece = self.piece.get(role, need)
            while need > 0:
                size = min(piece, need)
                k = layer if role == "activations" else len(held) % self.layers
                addr = al.malloc(size, self.frames[(role, k)])
                if addr is None:  # the scripted device is full: nothing more to record
                    return
                held.append((addr, size))
                need -= size


def _points(src: Any, step: int, t_rec: float, t_b: float) -> list[tuple]:
    """(t, phase, x, grid index or None) of one step up to t_b, in time order: the grid, and
    the recording's first and last moments (so a recording shorter than a grid step still holds
    what changed in it, and the trace spans the whole recording)."""
    out, f0 = [], step * src.step_s
    for k, ph in enumerate(src.PHASES):
        n, span = GRID[ph], src.SPANS[ph] * src.step_s
        for i in range(n + 1):
            out.append((f0 + span * i / n, k, i, ph, i / n, i))
        for t in (t_rec, t_b):
            if f0 < t < f0 + span:
                out.append((t, k, n + 0.5 * (t == t_b), ph, (t - f0) / span, None))
        f0 += span
    out.sort(key=lambda p: p[:3])
    return [(t, ph, x, i) for t, _, _, ph, x, i in out if t <= t_b]


def build(src: Any, since: float, until: float, max_entries: int | None = None,
          timeline: list | None = None) -> dict:
    """The snapshot of the recording [since, until] (unix seconds) in torch's format; fills
    ``timeline`` (if a list) with the script's steps and phases in the trace's clock."""
    script_now = src._clock() - src._t0
    wall_now = src._wall()
    step_s = src.step_s

    def us(t: float) -> int:  # script seconds -> unix microseconds
        return int(round((wall_now + (t - script_now)) * 1e6))

    t_a = max(0.0, script_now - (wall_now - since))
    t_b = max(t_a, script_now - (wall_now - until))
    s_a, s_b = int(t_a / step_s), int(t_b / step_s)
    # a long recording: torch keeps the last max_entries events; replay only what can be kept
    if max_entries:
        s_a = max(s_a, s_b - max_entries // MIN_EVENTS_PER_STEP - 2)
    t_rec = max(t_a, s_a * step_s) if s_a > int(t_a / step_s) else t_a
    phases = src.PHASES
    segments, traces, ann = [], [], []
    for dev_index in src.device_indices():
        dev = src._st[dev_index]
        rp = _Replay(dev, src.TOTAL)
        al = rp.al
        al.recording = t_rec <= 0.0
        al.t = us(0.0)
        if s_a > 0:  # what the program holds at the start of step s_a, allocated earlier
            al.recording = False
            rp.to(_targets(dev, s_a, "data", 0.0), 0)
        else:
            rp.to(_targets(dev, 0, "data", 0.0), 0)
        for step in range(s_a, s_b + 1):
            retried = False
            for t, ph, x, i in _points(src, step, t_rec, t_b):
                al.t = us(t)
                al.recording = t >= t_rec
                if i == 0 and ph in ("optimizer", "zero_grad"):  # torch's record_function
                    al.annotate("Optimizer.step#AdamW.step",
                                "START" if ph == "optimizer" else "END")
                if (ph == "forward" and x > 0.6 and not retried and src.retry_every
                        and step > 0 and step % src.retry_every == 0):
                    retried = True  # the source's scripted cudaMalloc retry: cache flushed
                    al.release_cached()
                # the forward's grid point i allocates layer (i - 1) * layers // n's output
                layer = 0
                if ph == "forward":
                    layer = (max(0, i - 1) * rp.layers // GRID[ph] if i is not None
                             else min(rp.layers - 1, int(x * rp.layers)))
                rp.to(_targets(dev, step, ph, x), layer)
        snap, _ = al.snapshot(max_entries)
        segments += snap["segments"]
        tr = snap["device_traces"][dev_index]
        while len(traces) <= dev_index:
            traces.append([])
        traces[dev_index] = tr
        ann += snap["external_annotations"]
    if timeline is not None:
        for step in range(s_a, s_b + 1):
            f0, rec = step * step_s, {"step": step + 1, "phases": []}
            rec["start_us"] = us(f0)
            for ph in phases:
                f1 = f0 + src.SPANS[ph] * step_s
                rec["phases"].append({"phase": ph, "start_us": us(f0),
                                      "end_us": us(f1) if f1 <= t_b else None})
                f0 = f1
            rec["end_us"] = us(f0) if f0 <= t_b else None
            if rec["start_us"] <= us(t_b):
                rec["phases"] = [p for p in rec["phases"] if p["start_us"] <= us(t_b)]
                timeline.append(rec)
    return {"segments": segments, "device_traces": traces,
            "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": "", "max_split_size": -1,
                                   "garbage_collection_threshold": 0.0,
                                   "expandable_segments": False},
            "external_annotations": ann}
