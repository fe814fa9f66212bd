"""Synthetic memory snapshots in torch's format, for tests, benchmarks and demos.

A small model of the CUDA caching allocator (segments split into blocks, best fit, merge on
free, 2 MiB small-pool segments, large segments rounded up) runs a scripted training loop
(parameters, a forward ramp of activations, backward with gradients, AdamW's first-step state and
foreach temporaries, zero_grad) and records the trace the way `_record_memory_history` does:
recording may start after the parameters exist and the trace is a ring of `max_entries`, so the
window starts mid-run. `truth` is the exact allocated (requested) bytes after each kept event.
"""
from __future__ import annotations

import random

SMALL = 1 << 20
MB2 = 2 << 20


def _stack(user_file: str, user_line: int, user_fn: str, torch_fn: str) -> list:
    return [
        {"filename": "/usr/lib/python3/site-packages/torch/nn/functional.py", "line": 2000,
         "name": torch_fn},
        {"filename": "/usr/lib/python3/site-packages/torch/nn/modules/module.py", "line": 1750,
         "name": "_call_impl"},
        {"filename": user_file, "line": user_line, "name": user_fn},
        {"filename": "/home/user/proj/train.py", "line": 88, "name": "main"},
        {"filename": "<frozen runpy>", "line": 198, "name": "_run_module_as_main"},
    ]


# What torch's combined unwinder puts before the Python frames of a stacks='all' trace
# (innermost first): the unwinder, the caching allocator, the op's glue; and after them the
# interpreter's C frames. Shared dicts, as torch's symbolizer shares them.
_CPP_HEAD = [{"filename": "??", "line": 0, "name": n} for n in (
    "torch::unwind::unwind()", "torch::CapturedTraceback::gather(bool, bool, bool)",
    "c10::cuda::CUDACachingAllocator::Native::DeviceCachingAllocator::malloc(...)",
    "c10::cuda::CUDACachingAllocator::Native::NativeCachingAllocator::malloc(...)",
    "c10::cuda::CUDACachingAllocator::Native::NativeCachingAllocator::allocate(unsigned long)",
    "at::TensorBase at::detail::_empty_generic<long>(...)", "at::detail::empty_generic(...)",
    "at::detail::empty_cuda(...)", "at::native::empty_cuda(...)",
    "at::(anonymous namespace)::create_out(...)",
    "c10::impl::wrap_kernel_functor_unboxed_<...>::call(...)", "at::_ops::addmm::call(...)",
    "torch::autograd::VariableType::(anonymous namespace)::addmm(...)",
    "at::_ops::addmm::call(...)", "torch::autograd::THPVariable_addmm(...)",
    "cfunction_call", "_PyObject_MakeTpCall", "_PyEval_EvalFrameDefault")]
_CPP_TAIL = [{"filename": "??", "line": 0, "name": n} for n in (
    "_PyEval_EvalFrameDefault", "PyEval_EvalCode", "run_eval_code_obj", "run_mod",
    "_PyRun_SimpleFileObject", "Py_RunMain", "__libc_start_main", "_start")]


class SynthAllocator:
    def __init__(self, capacity: int, seed: int = 0, device: int = 0, all_stacks: bool = False,
                 tick: bool = True):
        self.capacity = capacity
        # tick=False: the caller keeps the clock (sets ``t``, unix microseconds, before each
        # call) instead of the random 1-40 us between events (gpumon/agent/sim_snapshot.py)
        self.tick = tick
        # like torch's stacks='all': C++ frames around the Python ones and a new frame list per
        # event (torch symbolizes each event's traceback into its own list of shared dicts)
        self.all_stacks = all_stacks
        self.rng = random.Random(seed)
        self.device = device
        self.segments: list[dict] = []
        self.next_addr = 0x7F0000000000
        self.events: list[dict] = []
        self.truth: list[int] = []
        self.rtruth: list[int] = []   # reserved bytes after each kept event
        self.allocated = 0
        self.reserved = 0
        self.t = 1_700_000_000_000_000
        self.recording = True
        self.where: dict[int, tuple[dict, dict]] = {}
        self.annotations: list[dict] = []

    def _tick(self):
        if not self.tick:
            return self.t
        self.t += self.rng.randint(1, 40)
        return self.t

    def _emit(self, **e):
        e["time_us"] = self._tick()
        e.setdefault("stream", 0)
        e.setdefault("frames", [])
        if self.all_stacks and e["frames"]:
            e["frames"] = _CPP_HEAD + e["frames"] + _CPP_TAIL
        if self.recording:
            self.events.append(e)
            self.truth.append(self.allocated)
            self.rtruth.append(self.reserved)

    def annotate(self, name: str, stage: str):
        if self.recording:
            self.annotations.append({"name": name, "stage": stage, "device": self.device,
                                     "time_us": self._tick()})

    def malloc(self, size: int, frames: list) -> int | None:
        rounded = max(512, (size + 511) // 512 * 512)
        pool = "small" if rounded <= SMALL else "large"
        best = None
        for seg in self.segments:
            if seg["segment_type"] != pool:
                continue
            for k, b in enumerate(seg["blocks"]):
                if b["state"] == "inactive" and b["size"] >= rounded and (
                        best is None or b["size"] < best[2]["size"]):
                    best = (seg, k, b)
        if best is None:
            segsize = MB2 if pool == "small" else (
                20 << 20 if rounded < (10 << 20) else (rounded + MB2 - 1) // MB2 * MB2)
            if self.reserved + segsize > self.capacity:
                self.release_cached()  # what the real allocator tries before giving up
            if self.reserved + segsize > self.capacity:
                self._emit(action="oom", size=size,
                           device_free=self.capacity - self.reserved, frames=frames)
                return None
            addr = self.next_addr
            self.next_addr += segsize + MB2
            seg = {"device": self.device, "address": addr, "total_size": segsize,
                   "allocated_size": 0, "active_size": 0, "requested_size": 0, "stream": 0,
                   "segment_type": pool, "segment_pool_id": (0, 0), "is_expandable": False,
                   "frames": frames if self.recording else [],
                   "blocks": [{"address": addr, "size": segsize, "requested_size": 0,
                               "state": "inactive", "frames": []}]}
            self.segments.append(seg)
            self.reserved += segsize
            self._emit(action="segment_alloc", addr=addr, size=segsize, frames=frames)
            best = (seg, 0, seg["blocks"][0])
        seg, k, b = best
        if b["size"] > rounded:
            rest = {"address": b["address"] + rounded, "size": b["size"] - rounded,
                    "requested_size": 0, "state": "inactive", "frames": []}
            seg["blocks"].insert(k + 1, rest)
            b["size"] = rounded
        b["state"] = "active_allocated"
        b["requested_size"] = size
        b["frames"] = frames if self.recording else []
        self.where[b["address"]] = (seg, b)
        self.allocated += size
        self._emit(action="alloc", addr=b["address"], size=size, frames=frames)
        return b["address"]

    def release_cached(self):
        for seg in list(self.segments):
            if len(seg["blocks"]) == 1 and seg["blocks"][0]["state"] == "inactive":
                self.reserved -= seg["total_size"]
                self.segments.remove(seg)  # before the event: its state is the one after it
                self._emit(action="segment_free", addr=seg["address"], size=seg["total_size"])

    def free(self, addr: int, frames: list | None = None):
        seg, b = self.where.pop(addr)
        size = b["requested_size"]
        fr = frames if frames is not None else b["frames"]
        # MemoryViz counts a request followed at once by its completion as freed at the request
        self.allocated -= size
        self._emit(action="free_requested", addr=addr, size=size, frames=fr)
        b["state"] = "inactive"
        b["requested_size"] = 0
        b["frames"] = []
        blocks = seg["blocks"]
        k = blocks.index(b)
        if k + 1 < len(blocks) and blocks[k + 1]["state"] == "inactive":
            b["size"] += blocks.pop(k + 1)["size"]
        if k > 0 and blocks[k - 1]["state"] == "inactive":
            blocks[k - 1]["size"] += b["size"]
            blocks.pop(k)
        self._emit(action="free_completed", addr=addr, size=size, frames=fr)

    def snapshot(self, max_entries: int | None = None) -> tuple[dict, list[int]]:
        for seg in self.segments:
            act = [b for b in seg["blocks"] if b["state"] != "inactive"]
            seg["allocated_size"] = sum(b["size"] for b in act)
            seg["active_size"] = seg["allocated_size"]
            seg["requested_size"] = sum(b["requested_size"] for b in act)
        ev, truth = self.events, self.truth
        if max_entries is not None and len(ev) > max_entries:
            ev, truth = ev[-max_entries:], truth[-max_entries:]
        first_t = ev[0]["time_us"] if ev else 0
        ann = [a for a in self.annotations if a["time_us"] >= first_t]
        snap = {
            "segments": self.segments,
            "device_traces": [[] for _ in range(self.device)] + [ev],
            "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": "", "max_split_size": -1,
                                   "garbage_collection_threshold": 0.0,
                                   "expandable_segments": False},
            "external_annotations": ann,
        }
        return snap, list(truth)


def training_snapshot(steps: int = 3, layers: int = 6, acts_per_layer: int = 3,
                      hidden: int = 1 << 20, seed: int = 0, max_entries: int | None = None,
                      record_params: bool = False, oom_at_step: int | None = None,
                      oom_kind: str = "huge", capacity: int = 80 << 30,
                      small_per_layer: int = 2, timeline: list | None = None,
                      leak_per_step: int = 0, all_stacks: bool = False,
                      retain_per_step: int = 0, retain_maxlen: int = 3
                      ) -> tuple[dict, list[int]]:
    """A scripted AdamW training loop. `oom_kind`: "huge" (one absurd request), "full" (the
    activations keep growing until the device is full), "fragmented" (small holes, then a
    request no hole fits). `leak_per_step`: bytes the loop keeps every step and never frees
    (a loss history kept on the GPU, train.py:120). `retain_per_step`: bytes kept each step in a
    deque(maxlen=retain_maxlen) (train.py:130): bounded retention, not a leak. `timeline`: if a list, it receives the loop's steps and phases as
    gpumon's phases tracker reports them in a snapshot sidecar (gpumon/agent/phases/
    timeline.py): forward, backward, optimizer; a step ends with the optimizer step and the
    next one starts there with zero_grad ("other"); the last is open (``end_us`` None)."""
    al = SynthAllocator(capacity, seed, all_stacks=all_stacks)
    rng = al.rng
    stacks = {}
    step_rec: dict = {}

    def enter(phase: str) -> None:  # times are the trace's own (no tick: the script is unchanged)
        if timeline is None:
            return
        if not step_rec:
            step_rec.update(step=1, start_us=al.t, end_us=None, phases=[])
        ph = step_rec["phases"]
        if ph:
            ph[-1]["end_us"] = al.t
        ph.append({"phase": phase, "start_us": al.t, "end_us": None})

    def step_end() -> None:
        if timeline is None or not step_rec:
            return
        step_rec["end_us"] = step_rec["phases"][-1]["end_us"] = al.t
        timeline.append(dict(step_rec))
        n = step_rec["step"] + 1
        step_rec.clear()
        step_rec.update(step=n, start_us=al.t, end_us=None, phases=[])
        enter("other")

    def done() -> tuple[dict, list[int]]:
        if timeline is not None and step_rec:
            timeline.append(dict(step_rec))
        return al.snapshot(max_entries)

    def st(kind, layer):
        key = (kind, layer)
        if key not in stacks:
            fn = {"act": "forward", "grad": "backward", "state": "step", "tmp": "_multi_tensor_adamw",
                  "small": "forward", "param": "__init__", "big": "forward"}[kind]
            ufile = "/home/user/proj/model.py" if kind in ("act", "small", "param", "big") \
                else "/home/user/proj/train.py"
            stacks[key] = _stack(ufile, 10 + ((sum(map(ord, kind)) + 7 * layer) % 90 if kind != "act" else layer),
                                 fn if kind != "act" else f"Block{layer}.forward",
                                 {"act": "linear", "grad": "backward", "state": "zeros_like",
                                  "tmp": "_foreach_mul", "small": "layer_norm", "param": "empty",
                                  "big": "matmul"}[kind])
            if kind == "param":  # made in a module's __init__, as nn.Linear makes its weight
                stacks[key] = [{"filename": "/usr/lib/python3/site-packages/torch/nn/modules/"
                                "linear.py", "line": 106, "name": "__init__"}] + stacks[key][2:]
        return stacks[key]

    al.recording = record_params
    params = [al.malloc(hidden * 4 + rng.randint(0, 7) * 512, st("param", k)) for k in range(layers)]
    al.recording = True
    state: list[int] = []
    retained: list[int] = []
    for step in range(steps):
        acts: list[int] = []
        smalls: list[int] = []
        enter("forward")
        for k in range(layers):
            for a in range(acts_per_layer):
                sz = hidden * (2 + (a % 3)) + rng.randint(0, 31) * 512
                p = al.malloc(sz, st("act", k))
                if p is None:
                    return done()
                acts.append(p)
            for s in range(small_per_layer):
                p = al.malloc(rng.randint(1, 64) * 512, st("small", k))
                if p is None:
                    return done()
                smalls.append(p)
        if oom_at_step == step and oom_kind == "full":
            while True:  # activations that never stop growing (a sequence length too long)
                if al.malloc(hidden * 3 + rng.randint(0, 31) * 512, st("act", layers - 1)) is None:
                    return done()
        if oom_at_step == step and oom_kind == "huge":
            if al.malloc(capacity * 50, st("big", 0)) is None:
                return done()
        if oom_at_step == step and oom_kind == "fragmented":
            # free every other activation: many holes, none large enough for what follows
            for p in acts[::2]:
                al.free(p)
            acts = acts[1::2]
            al.capacity = al.reserved  # the device has nothing left beyond PyTorch's cache
            largest = max(b["size"] for s in al.segments for b in s["blocks"]
                          if b["state"] == "inactive")
            if al.malloc(largest + (1 << 20), st("big", 0)) is None:
                return done()
        grads = []
        enter("backward")
        for k in reversed(range(layers)):
            grads.append(al.malloc(hidden * 4, st("grad", k)))
            for _ in range(acts_per_layer):
                al.free(acts.pop())
            for _ in range(small_per_layer):
                al.free(smalls.pop())
        al.annotate("Optimizer.step#AdamW.step", "START")
        enter("optimizer")
        if not state:
            for k in range(layers):
                state.append(al.malloc(hidden * 4, st("state", k)))
                state.append(al.malloc(hidden * 4, st("state", k)))
        tmps = [al.malloc(hidden * 4, st("tmp", k)) for k in range(layers)]
        for p in tmps:
            al.free(p)
        al.annotate("Optimizer.step#AdamW.step", "END")
        if leak_per_step:
            al.malloc(leak_per_step, _stack("/home/user/proj/train.py", 120, "main", "detach"))
        if retain_per_step:
            retained.append(al.malloc(retain_per_step, _stack("/home/user/proj/train.py", 130,
                                                              "main", "clone")))
            if len(retained) > retain_maxlen:
                al.free(retained.pop(0))
        step_end()
        al.annotate("Optimizer.zero_grad#AdamW.zero_grad", "START")
        for p in grads:
            al.free(p)
        al.annotate("Optimizer.zero_grad#AdamW.zero_grad", "END")
    del params
    return done()


def snapshot_with_events(n_events: int, seed: int = 0, all_stacks: bool = False) -> dict:
    """A training snapshot with about n_events trace entries (a ring of exactly n_events);
    `all_stacks`: stacks as torch's stacks='all' writes them (see SynthAllocator)."""
    layers, acts = 24, 8
    per_step = layers * (acts * 3 + 2 * 3 + 3) + layers * 2 * 3 + 8
    steps = max(2, n_events // per_step + 2)
    snap, _ = training_snapshot(steps=steps, layers=layers, acts_per_layer=acts,
                                hidden=1 << 18, seed=seed, max_entries=n_events)
    return snap
