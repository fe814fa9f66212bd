"""Where the agent's figures come from: the real torch CUDA allocator (+ NVML), or a simulation.

A source has ``kind``, ``ready()``, ``setup()``, ``device_indices()``, ``device_info()``,
``refresh() -> bool`` (device set changed), ``read() -> list[dict]`` (the hot path, one dict of
DEVICE_FIELDS per device), ``reset_peaks()``, ``info()`` (torch version, allocator) and
optionally ``phase_step() -> (phase, step)``.

The torch source never imports torch (it takes it from ``sys.modules``), never serves before the
program has initialised CUDA, and never touches a device the program has not used: it reads
only devices that already have a primary context, and reads NVML (not ``mem_get_info``, which
creates a context) for the device-wide figures.
"""
from __future__ import annotations

import math
import os
import sys
import time
from typing import Any

GiB = 1024 ** 3
MiB = 1024 ** 2


def nvml_error_line(e: BaseException) -> str:
    """Why NVML does not answer, in one line: a machine without NVIDIA's driver (no
    libnvidia-ml) is said as such, not as NVML's exception name."""
    name = type(e).__name__
    if "LibraryNotFound" in name or "DriverNotLoaded" in name:
        return "no NVIDIA driver here (NVML's library is not found)"
    return f"NVML unavailable: {_one_line(e)}"


def _one_line(e: BaseException) -> str:
    s = str(e).strip().splitlines()
    return f"{type(e).__name__}: {s[0]}" if s else type(e).__name__


def _own_pids() -> set[int]:
    """This process's pid in every pid namespace we can see (NVML may report another one)."""
    pids = {os.getpid()}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("NSpid:"):
                    pids.update(int(x) for x in line.split()[1:])
    except (OSError, ValueError):
        pass
    return pids


def _strip_uuid(u: str) -> str:
    return u[4:] if u[:4] in ("GPU-", "MIG-") else u


def _nvml_form(u: str | None) -> str | None:
    """torch's device UUID as NVML, nvidia-smi -L and DCGM write it: ``GPU-<uuid>`` (torch
    leaves the prefix out). A MIG instance can't be told from torch's figure alone: NVML's
    own text is used where NVML is there (``_nvml_uuid``)."""
    if not u or u.startswith(("GPU-", "MIG-")):
        return u
    return "GPU-" + u


def allocator_info(torch: Any = None) -> dict[str, Any]:
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF")
    backend = None
    if torch is not None:
        try:
            backend = torch.cuda.get_allocator_backend()
        except Exception:
            backend = None
    elif conf is None or "cudaMallocAsync" not in conf:
        backend = "native"
    expandable = None
    if conf is not None:
        expandable = False
        for part in conf.split(","):
            k, _, v = part.partition(":")
            if k.strip() == "expandable_segments":
                expandable = v.strip().lower() in ("true", "1")
    elif backend is not None:
        expandable = False
    return {"backend": backend, "conf": conf, "expandable_segments": expandable}


class Nvml:
    """Every NVML query goes through ``call``, which turns any error into None (like nvitop),
    so callers never branch on NVML failures. ``error`` is None or why NVML is unavailable."""

    def __init__(self) -> None:
        self.error: str | None = None
        self._nv: Any = None
        try:
            import pynvml  # nvidia-ml-py
            pynvml.nvmlInit()
            self._nv = pynvml
        except ImportError:
            self.error = "pynvml (nvidia-ml-py) is not installed"
        except Exception as e:
            self.error = nvml_error_line(e)

    @property
    def ok(self) -> bool:
        return self._nv is not None

    def call(self, name: str, *args: Any) -> Any:
        if self._nv is None:
            return None
        try:
            return getattr(self._nv, name)(*args)
        except Exception:
            return None

    def handle_by_uuid(self, uuid: str | None, pci_bus_id: str | None = None) -> Any:
        """The NVML handle of the device torch calls ``uuid`` (torch omits NVML's prefix)."""
        if self._nv is None:
            return None
        if uuid:
            u = str(uuid)
            cands = [u] if u.startswith(("GPU-", "MIG-")) else ["GPU-" + u, "MIG-" + u, u]
            for c in cands:
                h = self.call("nvmlDeviceGetHandleByUUID", c)
                if h is not None:
                    return h
            # Fall back to comparing every device's UUID (some drivers want bytes).
            n = self.call("nvmlDeviceGetCount") or 0
            for i in range(n):
                h = self.call("nvmlDeviceGetHandleByIndex", i)
                du = self.call("nvmlDeviceGetUUID", h)
                if isinstance(du, bytes):
                    du = du.decode(errors="replace")
                if du and _strip_uuid(str(du)) == _strip_uuid(u):
                    return h
        if pci_bus_id:
            return self.call("nvmlDeviceGetHandleByPciBusId", pci_bus_id)
        return None

    def memory(self, handle: Any) -> tuple[int | None, int | None]:
        m = self.call("nvmlDeviceGetMemoryInfo", handle) if handle is not None else None
        if m is None:
            return None, None
        return int(m.used), int(m.total)

    def process_used(self, handle: Any, pids: set[int]) -> int | None:
        """Bytes NVML says this process uses on the device; None if unknown."""
        if handle is None:
            return None
        procs = self.call("nvmlDeviceGetComputeRunningProcesses", handle)
        if procs is None:
            return None
        total = None
        for p in procs:
            if getattr(p, "pid", None) in pids:
                used = getattr(p, "usedGpuMemory", None)
                if isinstance(used, int) and used < 2 ** 63:
                    total = (total or 0) + used
        return total

    def pids_on(self, handle: Any) -> list[int] | None:
        procs = self.call("nvmlDeviceGetComputeRunningProcesses", handle)
        return None if procs is None else [int(p.pid) for p in procs]


# Figures the UI expects; every read returns all of them.
_NONE_NVML = (None, None)


class TorchSource:
    kind = "torch"

    # Device-wide used/total (~8 us, and a GIL release that a Python-bound loop pays a hand-over
    # for): twice a second is plenty for a figure that shows free memory, not a chart line.
    NVML_MEM_PERIOD = 0.5
    # The running-process list costs ~400 us: every 5 s, or after 1 s once reserved memory has
    # moved (this process's NVML figure is reserved + a near-constant context), which keeps
    # the mean cost per sample low at 10 Hz.
    NVML_PROC_PERIOD = 5.0
    NVML_PROC_MIN_PERIOD = 1.0
    DEVICE_PERIOD = 1.0     # re-check which devices have a context

    def __init__(self) -> None:
        self._torch: Any = None
        self._stats: Any = None
        self._devices: list[int] = []
        self._info: dict[int, dict[str, Any]] = {}
        self._handles: dict[int, Any] = {}
        self._nvml_mem: dict[int, tuple[int | None, int | None]] = {}
        self._nvml_proc: dict[int, int | None] = {}
        self._nvml_mem_t = 0.0
        self._proc_at: dict[int, tuple[float, int | None]] = {}  # (when, reserved then)
        self._devices_t = 0.0
        self.nvml: Nvml | None = None
        self._pids = _own_pids()

    # -- readiness: torch imported by the program and CUDA initialised by it --------------
    def ready(self) -> bool:
        torch = sys.modules.get("torch")
        cuda = getattr(torch, "cuda", None) if torch is not None else None
        if cuda is None:
            return False
        try:
            if not cuda.is_initialized():
                return False
            self._torch = torch
            # looked up at each call: the phases part answers it with the program's own view
            # of the peaks (gpumon/agent/phases/counters.py)
            self._stats = lambda i: torch._C._cuda_memoryStats(i)
            return bool(self._find_devices())
        except Exception:
            return False

    def _find_devices(self) -> list[int]:
        """Devices the program has touched: those with a primary context. Never creates one."""
        C = self._torch._C
        try:
            n = int(C._cuda_getDeviceCount())
        except Exception:
            n = 0
        has_ctx = getattr(C, "_cuda_hasPrimaryContext", None)
        if has_ctx is not None:
            devs = []
            for i in range(n):
                try:
                    if has_ctx(i):
                        devs.append(i)
                except Exception:
                    pass
            return devs
        # Old torch without the query: the devices whose allocator holds memory.
        devs = []
        for i in range(n):
            try:
                if self._stats(i).get("reserved_bytes", {}).get("all", {}).get("current", 0):
                    devs.append(i)
            except Exception:
                pass
        return devs

    def setup(self) -> None:
        self.nvml = Nvml()
        self._devices = self._find_devices()
        for i in self._devices:
            self._add_device(i)
        self._devices_t = time.monotonic()

    def _add_device(self, i: int) -> None:
        name = uuid = pci = None
        total = None
        try:
            p = self._torch.cuda.get_device_properties(i)
            name, total = p.name, int(p.total_memory)
            u = getattr(p, "uuid", None)
            uuid = str(u) if u is not None else None
            if hasattr(p, "pci_bus_id"):
                pci = "%08X:%02X:%02X.0" % (getattr(p, "pci_domain_id", 0), p.pci_bus_id,
                                            getattr(p, "pci_device_id", 0))
        except Exception:
            pass
        h = self.nvml.handle_by_uuid(uuid, pci) if self.nvml is not None else None
        uuid = self._nvml_uuid(h) or _nvml_form(uuid)
        self._handles[i] = h
        self._info[i] = {"index": i, "name": name, "total": total, "uuid": uuid}
        self._nvml_mem[i] = self.nvml.memory(h) if self.nvml is not None else _NONE_NVML
        self._nvml_proc[i] = self.nvml.process_used(h, self._pids) if self.nvml else None

    def _nvml_uuid(self, handle: Any) -> str | None:
        if handle is None or self.nvml is None:
            return None
        try:
            u = self.nvml.call("nvmlDeviceGetUUID", handle)
        except Exception:
            return None
        if isinstance(u, bytes):
            u = u.decode(errors="replace")
        return str(u) if u else None

    def refresh(self) -> bool:
        now = time.monotonic()
        if now - self._devices_t < self.DEVICE_PERIOD:
            return False
        self._devices_t = now
        devs = self._find_devices()
        if devs == self._devices or not devs:
            return False
        for i in devs:
            if i not in self._info:
                self._add_device(i)
        self._devices = devs
        return True

    def device_indices(self) -> list[int]:
        return list(self._devices)

    def device_info(self) -> list[dict[str, Any]]:
        return [dict(self._info[i]) for i in self._devices]

    def info(self) -> dict[str, Any]:
        return {"torch": getattr(self._torch, "__version__", None) if self._torch else None,
                "allocator": allocator_info(self._torch),
                "nvml": None if self.nvml is None else self.nvml.error}

    # -- the hot path ---------------------------------------------------------------------
    def read(self, fresh: bool = False) -> list[dict[str, Any]]:
        """One dict per device. fresh: read NVML now too (else its figures may be up to
        NVML_MEM_PERIOD / NVML_PROC_PERIOD old)."""
        now = time.monotonic()
        nv = self.nvml
        nv_ok = nv is not None and nv.ok
        mem_due = nv_ok and (fresh or now - self._nvml_mem_t >= self.NVML_MEM_PERIOD)
        if mem_due:
            self._nvml_mem_t = now
        stats = self._stats
        out = []
        for i in self._devices:
            s = stats(i)  # the nested dict: one C++ read under the allocator's mutex, no flatten
            try:
                ab = s["allocated_bytes"]["all"]
                rb = s["reserved_bytes"]["all"]
                ac = s["active_bytes"]["all"]
                d = {
                    "index": i,
                    "allocated": ab["current"], "reserved": rb["current"],
                    "active": ac["current"],
                    "requested": s["requested_bytes"]["all"]["current"],
                    "inactive_split": s["inactive_split_bytes"]["all"]["current"],
                    "peak_allocated": ab["peak"], "peak_reserved": rb["peak"],
                    "peak_active": ac["peak"],
                    "segments": s["segment"]["all"]["current"],
                    "alloc_retries": s["num_alloc_retries"], "ooms": s["num_ooms"],
                    "device_alloc": s.get("num_device_alloc"),
                    "device_free": s.get("num_device_free"),
                }
            except (KeyError, TypeError):
                d = _read_defensive(i, s)
            if mem_due:
                self._nvml_mem[i] = nv.memory(self._handles.get(i))
            if nv_ok:
                last_t, last_res = self._proc_at.get(i, (-1e18, None))
                age = now - last_t
                if fresh or age >= self.NVML_PROC_PERIOD or (
                        age >= self.NVML_PROC_MIN_PERIOD and d["reserved"] != last_res):
                    self._nvml_proc[i] = nv.process_used(self._handles.get(i), self._pids)
                    self._proc_at[i] = (now, d["reserved"])
            used, total = self._nvml_mem.get(i, _NONE_NVML)
            d["nvml_used"] = used
            d["nvml_total"] = total
            d["proc_used"] = self._nvml_proc.get(i)
            out.append(d)
        return out

    def reset_peaks(self) -> None:
        for i in self._devices:
            self._torch._C._cuda_resetPeakMemoryStats(i)


def _read_defensive(i: int, s: Any) -> dict[str, Any]:
    """Older torch versions lack some keys: every missing figure is None."""
    s = s if isinstance(s, dict) else {}

    def g(stat: str, what: str = "current") -> Any:
        v = s.get(stat)
        v = v.get("all") if isinstance(v, dict) else None
        return v.get(what) if isinstance(v, dict) else None

    return {
        "index": i, "allocated": g("allocated_bytes"), "reserved": g("reserved_bytes"),
        "active": g("active_bytes"), "requested": g("requested_bytes"),
        "inactive_split": g("inactive_split_bytes"),
        "peak_allocated": g("allocated_bytes", "peak"), "peak_reserved": g("reserved_bytes", "peak"),
        "peak_active": g("active_bytes", "peak"), "segments": g("segment"),
        "alloc_retries": s.get("num_alloc_retries"), "ooms": s.get("num_ooms"),
        "device_alloc": s.get("num_device_alloc"), "device_free": s.get("num_device_free"),
    }


class SimulatedSource:
    """A GPU training step, scripted: what the caching allocator would report for a small model
    trained with AdamW. For tests and the demo on machines without CUDA; never used in place of
    the real source where CUDA is present.

    One step of ``step_s`` seconds: forward (activations ramp up), backward (activations freed
    as gradients appear), optimizer step (the first step allocates AdamW's two state tensors per
    parameter, each step a foreach temporary), zero_grad (gradients freed). Reserved memory
    grows in 2 MiB-rounded segments and is kept (the cache); fragmentation shows as
    inactive-split bytes; every ``retry_every`` steps a cudaMalloc "fails" once: the cache is
    flushed (reserved drops to allocated) and num_alloc_retries rises.

    GPUMON_SIM_DEVICES: how many devices (default 1; LOCAL_RANK picks one device per rank).
    GPUMON_SIM_STEP: seconds per step (default 1.0).
    GPUMON_SIM_READY: when the source becomes ready, as the torch source does at the program's
    first CUDA call: ``torch`` (default: once the program has imported torch) or ``now``.
    ``ready=`` (a callable) overrides both: the demo becomes ready when its model is built.

    ``events=True`` (or GPUMON_SIM_EVENTS=1) also scripts what the phase tracker sends for a
    real run, from the same script as the memory: a ``step`` event per step with its exact
    peak, the phase it fell in and the roles there, and a ``breakdown`` event at phase
    boundaries (parameters, gradients, optimizer state, activations, cache, non-PyTorch, now and
    at the peaks). Samples then count steps from 1, as the tracker does. The program's own
    tracker must be off then (GPUMON_PHASES=0): two sources of steps would not agree.
    ``output_bytes``: the model output (logits) size the step events report.
    """

    kind = "simulated"
    TOTAL = 24 * GiB
    CONTEXT = 520 * MiB  # what NVML sees beyond reserved: CUDA context, cuBLAS workspace

    def __init__(self, devices: list[int] | None = None, step_s: float | None = None,
                 params: int = 700 * MiB, activations: int = 1800 * MiB,
                 retry_every: int = 25, clock: Any = time.monotonic,
                 ready: Any = None, events: bool | None = None,
                 output_bytes: int | None = None, wall: Any = time.time) -> None:
        if ready is None:
            mode = (os.environ.get("GPUMON_SIM_READY") or "torch").strip().lower()
            # "torch": once the import is complete (a real first CUDA call cannot come before;
            # an agent that served mid-import had no torch.optim to count a snapshot's steps)
            ready = (lambda: True) if mode == "now" else _torch_imported
        self._ready = ready
        from gpumon.agent.jobenv import ranks_of
        rank, local_rank, _ = ranks_of(os.environ)
        if devices is None:
            if local_rank is not None and local_rank >= 0:
                devices = [local_rank]
            else:
                n = int(os.environ.get("GPUMON_SIM_DEVICES", "1") or 1)
                devices = list(range(max(1, n)))
        self._devices = devices
        self.step_s = float(step_s or os.environ.get("GPUMON_SIM_STEP", "1.0"))
        rank = rank if rank is not None and rank >= 0 else 0
        # Ranks differ a little (uneven batches), so an imbalance shows in the UI.
        self.params = params
        self.act = int(activations * (1.0 + 0.12 * rank))
        self.retry_every = retry_every
        self._clock = clock
        self._wall = wall  # unix time, to place the script in a snapshot's time_us clock
        self._t0 = clock()
        self._st = {i: _SimDevice(i, self) for i in devices}
        self.phase: str | None = None
        self.step: int | None = None
        self.events = (os.environ.get("GPUMON_SIM_EVENTS") == "1") if events is None else events
        self.output_bytes = output_bytes
        self._last: tuple[int, str] | None = None  # (step, phase) of the previous read
        self._last_breakdown = -1e9                 # clock of the last breakdown event
        self._step_peaks: dict[int, dict] = {}      # device -> its last step's exact peak
        self._run_peaks: dict[int, dict] = {}       # device -> the run's high-water mark

    def ready(self) -> bool:
        if not self._ready():
            return False
        self._ready = _always  # ready once, ready for good (as CUDA, once initialised)
        return True

    def setup(self) -> None:
        pass

    def refresh(self) -> bool:
        return False

    def device_indices(self) -> list[int]:
        return list(self._devices)

    def device_info(self) -> list[dict[str, Any]]:
        return [{"index": i, "name": "Simulated GPU (no CUDA)", "total": self.TOTAL,
                 "uuid": f"SIM-{i:08d}"} for i in self._devices]

    def info(self) -> dict[str, Any]:
        torch = sys.modules.get("torch")
        return {"torch": getattr(torch, "__version__", None), "allocator": allocator_info(None),
                "nvml": "simulated source: no NVML"}

    def phase_step(self) -> tuple[str | None, int | None]:
        if self.events and self.step is not None:
            return self.phase, self.step + 1  # 1-based, as the step events (and the tracker)
        return self.phase, self.step

    def _script(self, t: float) -> tuple[int, str, float]:
        step = int(t / self.step_s)
        return step, *self._phase_at((t / self.step_s) - step)

    @staticmethod
    def _phase_at(f: float) -> tuple[str, float]:
        if f < 0.05:
            return "data", f / 0.05
        if f < 0.45:
            return "forward", (f - 0.05) / 0.40
        if f < 0.80:
            return "backward", (f - 0.45) / 0.35
        if f < 0.95:
            return "optimizer", (f - 0.80) / 0.15
        return "zero_grad", (f - 0.95) / 0.05

    def read(self, fresh: bool = False) -> list[dict[str, Any]]:
        t = self._clock() - self._t0
        step, phase, x = self._script(t)
        self.phase, self.step = phase, step
        out = [self._st[i].read(step, phase, x) for i in self._devices]
        if self.events:
            try:
                self._script_events(step, phase, x)
            except Exception:  # a scripted extra must never stop the samples
                self.events = False
        return out

    # -- the scripted phase tracker (events=True) -------------------------------------------
    PHASES = ("data", "forward", "backward", "optimizer", "zero_grad")
    SPANS = {"data": 0.05, "forward": 0.40, "backward": 0.35, "optimizer": 0.15,
             "zero_grad": 0.05}

    # where the script's phases can peak: their ends, the backward's crossing of gradients
    # growing (1.2 x) and activations shrinking (x = 1/1.2), the optimizer's last moment with its
    # temporary (x < 0.8); the middle for safety
    PEAK_AT = (0.0, 0.5, 0.79, 1 / 1.2, 1.0)

    def step_peak(self, dev: int, step: int) -> dict:
        """The exact peak of a (0-based) step on one device, from the script: its bytes, the
        phase it falls in, each phase's peak and the roles at the peak."""
        d = self._st[dev]
        phase_peaks, best = {}, None
        for ph in self.PHASES:
            top = None
            for x in self.PEAK_AT:
                a = d.allocated(step, ph, x)
                if top is None or a > top[0]:
                    top = (a, x)
            phase_peaks[ph] = top[0]
            if best is None or top[0] > best[0]:
                best = (top[0], ph, top[1])
        peak, ph, x = best
        return {"peak": peak, "peak_phase": ph, "phase_peaks": phase_peaks,
                "at_peak": d.roles(step, ph, x), "step": step + 1}

    def _script_events(self, step: int, phase: str, x: float) -> None:
        from gpumon.agent import core
        last, self._last = self._last, (step, phase)
        if last is None or last == (step, phase):
            return
        last_step, last_phase = last
        if step != last_step:  # the previous step ended: its event, as the tracker sends it
            devs = []
            for i in self._devices:
                pk = self.step_peak(i, last_step)
                self._step_peaks[i] = pk
                run = self._run_peaks.get(i)
                if run is None or pk["peak"] > run["peak"]:
                    self._run_peaks[i] = pk
                d = self._st[i]
                devs.append({"index": i, "peak": pk["peak"], "peak_phase": pk["peak_phase"],
                             "peak_exact": True, "phase_peaks": pk["phase_peaks"],
                             "phase_peaks_exact": {p: True for p in pk["phase_peaks"]},
                             "at_peak": pk["at_peak"], "exact_note": None,
                             "start": d.allocated(last_step, "data", 0.0),
                             "end": d.allocated(last_step, "zero_grad", 1.0)})
            main = max(devs, key=lambda r: r["peak"])
            t_s, bounds = 0.0, []
            for ph in self.PHASES:
                bounds.append({"t": round(t_s, 4), "phase": ph, "allocated": [
                    self._st[i].allocated(last_step, ph, 0.0) for i in self._devices]})
                t_s += self.SPANS[ph] * self.step_s
            core.queue_event("step", {
                "step": last_step + 1, "t": time.time(), "time_s": self.step_s,
                "phases": {ph: {"time_s": self.SPANS[ph] * self.step_s, "count": 1}
                           for ph in self.PHASES},
                "forwards": 1, "backwards": 1, "optimizers": ["AdamW"],
                "optimizer_impl": ["foreach"], "output_bytes": self.output_bytes,
                "autocast": False, "peak": main["peak"], "peak_phase": main["peak_phase"],
                "peak_exact": True, "peak_device": main["index"], "exact_note": None,
                "devices": devs, "boundaries": bounds, "phases_note": None,
                "measured_every": 1})
        now = self._clock()
        if now - self._last_breakdown < 0.5 and step == last_step:
            return  # at most two a second, as the tracker keeps its cost down
        self._last_breakdown = now
        devs = []
        # what the tracker sends as a phase ends: the roles at that end (at 10 Hz the 50 ms
        # zero_grad falls between samples, and "now" was the next step's data phase: the
        # optimizer's end showed no gradients)
        end_step, end_x = (last_step, 1.0)
        for i in self._devices:
            d = self._st[i]
            alloc = d.allocated(end_step, last_phase, end_x)
            roles = d.roles(end_step, last_phase, end_x)
            roles["allocator_cache"] = max(0, d.reserved - alloc)
            roles["non_pytorch"] = SimulatedSource.CONTEXT
            pk, run = self._step_peaks.get(i), self._run_peaks.get(i)
            devs.append({"index": i, "now": roles, "allocated": alloc, "reserved": d.reserved,
                         "at_peak": pk and pk["at_peak"], "peak": pk and pk["peak"],
                         "peak_phase": pk and pk["peak_phase"], "peak_step": pk and pk["step"],
                         "peak_exact": pk is not None,
                         "run_peak": run and run["peak"],
                         "run_peak_phase": run and run["peak_phase"],
                         "run_peak_step": run and run["step"],
                         "at_run_peak": run and run["at_peak"], "retries": d.retries})
        core.queue_event("breakdown", {"step": end_step + 1, "phase": last_phase, "t": time.time(),
                                       "cost_us": 0, "tensors": 0, "devices": devs})

    def reset_peaks(self) -> None:
        for d in self._st.values():
            d.reset_peaks()

    def memory_snapshot(self, since: float, until: float, max_entries: int | None = None,
                        timeline: list | None = None) -> dict:
        """The memory snapshot of a recording from ``since`` to ``until`` (unix seconds), in
        torch's format, made from the same script as the samples (sim_snapshot.py): the steps
        that passed, at their times, with the bytes the samples showed. ``timeline`` (a list)
        receives the script's steps and phases in the trace's time_us clock."""
        from gpumon.agent import sim_snapshot
        return sim_snapshot.build(self, since, until, max_entries, timeline)


def _torch_imported() -> bool:
    mod = sys.modules.get("torch")
    return mod is not None and not getattr(getattr(mod, "__spec__", None), "_initializing", False)


def _always() -> bool:
    return True


class _SimDevice:
    SEG = 2 * MiB      # the rounding of a block
    SEGMENT = 20 * MiB  # one cudaMalloc'd segment: reserved grows and shrinks by these
    BATCH = 48 * MiB  # the data batch, on the device from the data phase to the backward's end

    def __init__(self, index: int, src: SimulatedSource) -> None:
        self.index = index
        self.src = src
        self.reserved = 0
        self.peak_alloc = self.peak_res = self.peak_act = 0
        self.retries = 0
        self.device_alloc = 0
        self.device_free = 0
        self.last_retry_step = -1
        self.frag = 0
        self._at: tuple[int, int, float] | None = None   # the script position of the last read

    def _peak_since(self, step: int, phase: str, x: float) -> int:
        """The script's highest allocated bytes from the last read to (step, phase, x), at the
        moments where its phases peak (SimulatedSource.PEAK_AT): the peak a 10 Hz sample misses
        and torch's max_memory_allocated does not."""
        phases = SimulatedSource.PHASES
        now = (step, phases.index(phase) if phase in phases else 0, x)
        last, self._at = self._at, now
        if last is None or last > now:
            return self._allocated(step, phase, x)
        last = max(last, (step - 2, 0, 0.0))   # after a long gap (a pause), the last two steps
        top = self._allocated(step, phase, x)
        s, i = last[0], last[1]
        while (s, i) <= now[:2]:
            for xp in SimulatedSource.PEAK_AT:
                if last <= (s, i, xp) <= now:
                    top = max(top, self._allocated(s, phases[i], xp))
            s, i = (s, i + 1) if i + 1 < len(phases) else (s + 1, 0)
        return top

    def roles(self, step: int, phase: str, x: float) -> dict[str, int]:
        """What holds the scripted allocated bytes at (step, phase, x in 0..1): parameters,
        gradients, AdamW's state, and activations (with the data batch and the optimizer's
        foreach temporaries, as the tracker counts everything else)."""
        P, A = self.src.params, self.src.act
        state = 2 * P if step > 0 or phase in ("optimizer", "zero_grad") else 0
        # Small wobble between steps (sequence lengths vary), deterministic in the step.
        A = int(A * (1.0 + 0.05 * math.sin(step * 1.3)))
        grads, act = 0, 0
        if phase == "data":
            act = int(self.BATCH * x)
        elif phase == "forward":
            act = self.BATCH + int(A * x)
        elif phase == "backward":
            act = self.BATCH + int(A * (1 - x))
            grads = int(P * min(1.0, x * 1.2))
        elif phase == "optimizer":
            # The first step allocates exp_avg and exp_avg_sq (2 x params) as it goes.
            state = 2 * P if step > 0 else int(2 * P * min(1.0, x * 2))
            grads = P
            act = int(P * 0.5) if x < 0.8 else 0  # a foreach temporary
        else:  # zero_grad(set_to_none) frees the grads
            state, grads = 2 * P, int(P * (1 - x))
        return {"parameters": P, "gradients": grads, "optimizer_state": state,
                "activations": act}

    def allocated(self, step: int, phase: str, x: float) -> int:
        return sum(self.roles(step, phase, x).values())

    _allocated = allocated

    def read(self, step: int, phase: str, x: float) -> dict[str, Any]:
        alloc = self._allocated(step, phase, x)
        if (self.src.retry_every and step > 0 and step % self.src.retry_every == 0
                and phase == "forward" and x > 0.6 and self.last_retry_step != step):
            # A cudaMalloc failed: the allocator freed its cached blocks and retried.
            self.last_retry_step = step
            self.retries += 1
            # the cached segments go back to CUDA (cudaFree), in the unit they came in
            keep = alloc + (-alloc) % self.SEGMENT
            self.device_free += max(0, self.reserved - keep) // self.SEGMENT
            self.reserved = min(self.reserved, keep)
            self.frag = 0
        peak = self._peak_since(step, phase, x)
        need = max(alloc, peak) + self.frag   # the allocator reserved what the peak used
        if need > self.reserved:
            grow = need - self.reserved
            grow += (-grow) % self.SEGMENT
            self.reserved += grow
            self.device_alloc += grow // self.SEGMENT
        # Fragmentation: split blocks left partly used; grows slowly, bounded.
        self.frag = min(self.frag + 3 * MiB, int(0.06 * self.reserved))
        inactive = min(self.frag, max(0, self.reserved - alloc))
        active = alloc + min(inactive // 4, 8 * MiB)
        self.peak_alloc = max(self.peak_alloc, peak)
        self.peak_res = max(self.peak_res, self.reserved)
        self.peak_act = max(self.peak_act, active, peak)   # active bytes include allocated
        used = self.reserved + SimulatedSource.CONTEXT
        return {
            "index": self.index, "allocated": alloc, "reserved": self.reserved, "active": active,
            "requested": alloc - alloc // 200, "inactive_split": inactive,
            "peak_allocated": self.peak_alloc, "peak_reserved": self.peak_res,
            # live segments = cudaMallocs - cudaFrees, as torch's counters agree
            "peak_active": self.peak_act, "segments": self.device_alloc - self.device_free,
            "alloc_retries": self.retries, "ooms": 0, "device_alloc": self.device_alloc,
            "device_free": self.device_free, "nvml_used": used, "nvml_total": SimulatedSource.TOTAL,
            "proc_used": used,
        }

    def reset_peaks(self) -> None:
        self.peak_alloc = self.peak_res = self.peak_act = 0


def make_source(kind: str | None) -> Any:
    kind = (kind or os.environ.get("GPUMON_SOURCE") or "torch").strip().lower()
    if kind == "simulated":
        return SimulatedSource()
    if kind == "torch":
        return TorchSource()
    raise ValueError(f"unknown GPUMON_SOURCE {kind!r}: use 'torch' or 'simulated'")
