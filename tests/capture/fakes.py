"""A stand-in for torch.cuda.memory's recording API (torch's CPU build can't record CUDA
history), shaped like the real one: a ring of trace entries that is cleared when recording is
disabled, a snapshot of plain data, an OOM observer list, optimizer step post-hooks."""
from __future__ import annotations

import threading


class Handle:
    def __init__(self, hooks, fn):
        self.hooks, self.fn = hooks, fn

    def remove(self):
        if self.fn in self.hooks:
            self.hooks.remove(self.fn)


class FakeMemoryAPI:
    kind = "torch"
    simulated = False

    def __init__(self, cuda_ready=True, recording=False):
        self.recording = recording
        self.trace: list[dict] = []
        self.max_entries = None
        self.stacks = None
        self.calls: list[tuple] = []
        self.observers: list = []
        self.step_hooks: list = []
        self.cuda_ready = cuda_ready
        self.ready_fns: list = []
        self.unavailable_reason = None
        self.fail_snapshot = None
        self.allocated = 123 << 20
        self.reserved = 456 << 20
        self.lock = threading.Lock()
        self.addr = 0x7F0000000000

    # what the program does
    def alloc(self, size, frames=None):
        with self.lock:
            self.addr += size
            if self.recording:
                self.trace.append({"action": "alloc", "addr": self.addr, "size": size,
                                   "stream": 0, "time_us": len(self.trace),
                                   "frames": frames or [{"filename": "train.py", "line": 1,
                                                         "name": "main"}]})
            return self.addr

    def oom(self, device=0, requested=10 << 40, total=80 << 30, free=1 << 30):
        if self.recording:
            self.trace.append({"action": "oom", "size": requested, "device_free": free,
                               "stream": 0, "time_us": len(self.trace), "frames": []})
        for fn in list(self.observers):
            fn(device, requested, total, free)

    def step(self, optimizer="adam"):
        for fn in list(self.step_hooks):
            fn(optimizer, (), {})

    def init_cuda(self):
        self.cuda_ready = True
        for fn in self.ready_fns:
            fn()
        self.ready_fns.clear()

    # the backend API
    def version(self):
        return "2.11.0+fake"

    def unavailable(self, initialising=False):
        return self.unavailable_reason

    def is_recording(self):
        return self.recording

    def start(self, stacks, max_entries):
        self.calls.append(("start", stacks, max_entries))
        self.recording, self.stacks, self.max_entries = True, stacks, max_entries

    def stop(self):
        self.calls.append(("stop",))
        self.recording = False
        self.trace.clear()  # like the real allocator: disabling history clears it

    def snapshot(self):
        if self.fail_snapshot:
            raise self.fail_snapshot
        with self.lock:
            return {"segments": [{"device": 0, "address": 1, "total_size": 2 << 20,
                                  "allocated_size": 1024, "active_size": 1024,
                                  "requested_size": 1000, "stream": 0, "segment_type": "small",
                                  "segment_pool_id": (0, 0), "is_expandable": False,
                                  "frames": [],
                                  "blocks": [{"address": 1, "size": 1024,
                                              "requested_size": 1000,
                                              "state": "active_allocated", "frames": []}]}],
                    "device_traces": [list(self.trace)],
                    "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": ""},
                    "external_annotations": []}

    def memory_figures(self, device):
        return {"allocated": self.allocated, "reserved": self.reserved}

    def when_cuda_ready(self, fn):
        if self.cuda_ready:
            fn()
        else:
            self.ready_fns.append(fn)
        return True

    def attach_oom_observer(self, fn):
        self.observers.append(fn)
        return True

    def register_step_hook(self, fn):
        self.step_hooks.append(fn)
        return Handle(self.step_hooks, fn)


class Events:
    """Collects broadcast events; wait() polls for a condition (robust under load)."""

    def __init__(self):
        self.items: list[tuple[str, dict]] = []
        self.cv = threading.Condition()

    def __call__(self, kind, **payload):
        with self.cv:
            self.items.append((kind, payload))
            self.cv.notify_all()

    def of(self, kind):
        with self.cv:
            return [p for k, p in self.items if k == kind]

    def wait(self, kind, n=1, timeout=20.0):
        with self.cv:
            ok = self.cv.wait_for(lambda: len([1 for k, _ in self.items if k == kind]) >= n,
                                  timeout)
        assert ok, f"no {kind} event within {timeout} s: {self.items}"
        return self.of(kind)
