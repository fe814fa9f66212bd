"""The snapshot part's backends: what the recorder (gpumon/agent/snapshot.py) needs from torch's
recording API (taken from ``sys.modules``, never imported here), or from the simulated source
(a scripted trace). Standard library only."""
from __future__ import annotations

import os
import sys
import time
from typing import Callable

MIN_TORCH = (2, 1)
DEFAULT_MAX_ENTRIES = 100_000


class TorchBackend:
    """The real path: torch.cuda.memory's private recording API, from sys.modules."""

    kind = "torch"
    simulated = False

    @staticmethod
    def _torch():
        return sys.modules.get("torch")

    def version(self) -> str | None:
        t = self._torch()
        return getattr(t, "__version__", None) if t else None

    def unavailable(self, initialising: bool = False) -> str | None:
        """Why snapshots can't be taken now, in one line, or None. ``initialising``: called
        from inside torch.cuda's lazy init, where is_initialized() is still False."""
        t = self._torch()
        if t is None or "torch.cuda" not in sys.modules:
            return "the program has not imported torch, so there is no CUDA memory to record"
        ver = _parse_version(getattr(t, "__version__", "0"))
        if ver < MIN_TORCH:
            return (f"torch {t.__version__} is too old for memory snapshots "
                    f"(needs {MIN_TORCH[0]}.{MIN_TORCH[1]} or newer)")
        mem = getattr(t.cuda, "memory", None)
        if mem is None or not hasattr(mem, "_record_memory_history") \
                or not hasattr(mem, "_snapshot"):
            return f"this torch ({t.__version__}) has no memory-history recording API"
        if getattr(getattr(t, "version", None), "cuda", None) is None:
            return (f"this torch ({t.__version__}) is a CPU build: there is no CUDA memory to "
                    "record")
        # Checked before anything else that might touch the driver: never make a context.
        if not initialising and not t.cuda.is_initialized():
            return "the program has not used CUDA yet; start a snapshot once training runs"
        try:
            backend = t.cuda.get_allocator_backend()
        except Exception:
            backend = "native"
        if backend == "cudaMallocAsync":
            return ("the allocator backend is cudaMallocAsync (PYTORCH_CUDA_ALLOC_CONF), which "
                    "keeps no allocation history; snapshots need the native caching allocator")
        return None

    def is_recording(self) -> bool:
        t = self._torch()
        fn = getattr(t._C, "_cuda_isHistoryEnabled", None)
        if fn is not None:
            return bool(fn())
        # Older builds: disabling history clears the trace, so a non-empty trace means it is on.
        s = t.cuda.memory._snapshot()
        return any(len(tr) for tr in s.get("device_traces", []))

    def start(self, stacks: str, max_entries: int) -> None:
        # These four arguments mean the same from 2.1 to today (2.8+ only add keywords).
        self._torch().cuda.memory._record_memory_history(
            enabled="all", context="all", stacks=stacks, max_entries=int(max_entries))

    def stop(self) -> None:
        self._torch().cuda.memory._record_memory_history(enabled=None)

    def snapshot(self) -> dict:
        return self._torch().cuda.memory._snapshot()

    def timeline(self, first_us: int | None, last_us: int | None) -> dict | None:
        """The phases tracker's steps and phases over the trace's time range."""
        phases = sys.modules.get("gpumon.agent.phases")
        return phases.timeline(first_us, last_us) if phases is not None else None

    def memory_figures(self, device: int) -> dict:
        c = self._torch().cuda
        return {"allocated": int(c.memory_allocated(device)),
                "reserved": int(c.memory_reserved(device))}

    def when_cuda_ready(self, fn: Callable[[], None]) -> bool:
        """Run fn once CUDA is initialised (at once if it is). False if torch isn't there yet."""
        t = self._torch()
        cuda = sys.modules.get("torch.cuda")
        if t is None or cuda is None or _importing(t) or _importing(cuda) \
                or not hasattr(cuda, "_lazy_call") or not hasattr(cuda, "is_initialized"):
            return False  # not imported, or still being imported by the program's thread
        # _lazy_call runs fn right after torch.cuda's lazy init, before the program's first
        # allocation; fn must never raise (an exception there would break the program's init).
        cuda._lazy_call(fn)
        return True

    def attach_oom_observer(self, fn) -> bool:
        t = self._torch()
        attach = getattr(t._C, "_cuda_attach_out_of_memory_observer", None)
        if attach is None:
            return False
        attach(fn)
        return True

    def register_step_hook(self, fn):
        # torch.optim does not always expose its submodule as an attribute (2.11+); the module
        # that defines Optimizer is loaded whenever torch.optim is, so take it from sys.modules.
        optim = self._torch().optim
        mod = sys.modules.get(optim.Optimizer.__module__)
        return mod.register_optimizer_step_post_hook(fn)

    def register_grad_hook(self, fn):
        """A global optimizer-step pre-hook (the grads are there, not yet stepped): for
        GradLog, while a recording is on."""
        optim = self._torch().optim
        mod = sys.modules.get(optim.Optimizer.__module__)
        return mod.register_optimizer_step_pre_hook(fn)


class SimulatedBackend:
    """For the simulated source (demo, CI): a snapshot in torch's exact format, produced by a
    scripted caching-allocator model of a training loop, clearly labelled as simulated (file
    name prefix, sidecar ``simulated: true``, every reply and event). If the agent's source can
    produce its own snapshot (``source.memory_snapshot(since, until, max_entries)``), that is
    used, so the snapshot matches the figures the client saw."""

    kind = "simulated"
    simulated = True

    def __init__(self, source=None):
        self.source = source
        self._recording = False
        self._since = None
        self._max_entries = DEFAULT_MAX_ENTRIES
        self._step_hooks: list = []
        self._timeline: list | None = None  # the scripted steps of the last snapshot

    def version(self):
        t = sys.modules.get("torch")
        return getattr(t, "__version__", None) if t else None

    def unavailable(self, initialising=False):
        return None

    def is_recording(self):
        return self._recording

    def start(self, stacks, max_entries):
        self._recording, self._since, self._max_entries = True, time.time(), max_entries

    def stop(self):
        self._recording = False

    def snapshot(self, steps: int | None = None) -> dict:
        """`steps`: the optimizer steps the recording counted (`snapshot --steps N`): the file
        then holds as many scripted steps, whatever the scripted clock says."""
        now = time.time()
        since = self._since or now
        fn = getattr(self.source, "memory_snapshot", None)
        self._timeline = None
        if callable(fn):  # the source's own script: the figures the client saw, at their times
            self._timeline = []
            snap = fn(since=since, until=now, max_entries=self._max_entries,
                      timeline=self._timeline)
            _label_simulated(snap)
            return snap
        from gpumon.snapshot import synth  # pure Python; only the demo/CI path needs it
        # Scaled like the simulated source's script: its parameter bytes over 6 layers, its
        # steps as they passed while recording (bounded, so the file stays small).
        params = int(getattr(self.source, "params", 700 << 20))
        step_s = float(getattr(self.source, "step_s", 1.0) or 1.0)
        steps = max(1, min(20, steps or int((now - since) / step_s) + 1))
        self._timeline = []
        snap, _ = synth.training_snapshot(
            steps=steps, layers=6, hidden=max(1 << 16, params // 24),
            capacity=int(getattr(self.source, "TOTAL", 24 << 30)),
            max_entries=self._max_entries, timeline=self._timeline)
        _label_simulated(snap)
        return snap

    def timeline(self, first_us, last_us):
        """The scripted loop's own steps and phases (the source's script, else synth.py), those
        the trace overlaps."""
        if self._timeline is None:
            return None
        steps = [s for s in self._timeline
                 if (last_us is None or s["start_us"] <= last_us)
                 and (first_us is None or s["end_us"] is None or s["end_us"] >= first_us)]
        return {"clock": "time_us", "steps": steps}

    def memory_figures(self, device):
        return {"allocated": None, "reserved": None}

    def when_cuda_ready(self, fn):
        return False  # no CUDA: the OOM observer never fires for the simulated source

    def attach_oom_observer(self, fn):
        return False

    def register_grad_hook(self, fn):
        return None  # the simulated snapshot's addresses are not the demo's tensors

    def register_step_hook(self, fn):
        mod = sys.modules.get("torch.optim.optimizer")
        if mod is not None and hasattr(mod, "register_optimizer_step_post_hook"):
            return mod.register_optimizer_step_post_hook(fn)  # the demo trains on the CPU
        return None


def _importing(mod) -> bool:
    """True while a module's import is still running (importlib's own marker)."""
    return bool(getattr(getattr(mod, "__spec__", None), "_initializing", False))


def _label_simulated(snap: dict) -> None:
    """Every frame's file says it is simulated, so no screen can mistake it for real code."""
    def fix(frames):
        for f in frames or ():
            fn = str(f.get("filename", ""))
            if not fn.startswith("<simulated>"):
                f["filename"] = "<simulated>/" + os.path.basename(fn)
    for seg in snap.get("segments", ()):
        fix(seg.get("frames"))
        for b in seg.get("blocks", ()):
            fix(b.get("frames"))
    for trace in snap.get("device_traces", ()):
        for e in trace:
            fix(e.get("frames"))


def _parse_version(v: str) -> tuple[int, int]:
    try:
        parts = v.split("+")[0].split(".")
        return int(parts[0]), int("".join(ch for ch in parts[1] if ch.isdigit()) or 0)
    except Exception:
        return (0, 0)
