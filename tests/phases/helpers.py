"""A fake allocator for the tracker: tests move its figures from inside real torch code."""
from __future__ import annotations

import torch

from gpumon.agent.phases import PhaseTracker


class FakeMemory:
    """allocated / peak / reserved like the caching allocator's, driven by the test."""

    def __init__(self, base: int = 1000) -> None:
        self.cur = base
        self.peak = base
        self.reserved = base * 2
        self.retries = 0

    def bump(self, n: int) -> None:
        self.cur += n
        self.peak = max(self.peak, self.cur)
        self.reserved = max(self.reserved, self.cur)

    def reset_peak(self) -> None:
        self.peak = self.cur

    def read(self, dev):
        return (self.cur, self.peak, self.reserved, self.retries)


class Bump(torch.autograd.Function):
    """Identity whose forward allocates ``n`` fake bytes and whose backward frees them."""

    @staticmethod
    def forward(ctx, x, mem, n):
        ctx.mem, ctx.n = mem, n
        mem.bump(n)
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        ctx.mem.bump(-ctx.n)
        return g, None, None


class Net(torch.nn.Module):
    """Linear layers; with a FakeMemory, forward holds ``act`` fake bytes until backward and
    makes a ``temp`` fake temporary that is gone before forward returns."""

    def __init__(self, mem: FakeMemory | None = None, act: int = 0, temp: int = 0) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 16)
        self.b = torch.nn.Linear(16, 4)
        self.register_buffer("scale", torch.ones(4))
        self.mem, self.act, self.temp = mem, act, temp

    def forward(self, x):
        h = torch.relu(self.a(x))
        if self.mem is not None and torch.is_grad_enabled():
            h = Bump.apply(h, self.mem, self.act)
            self.mem.bump(self.temp)
            self.mem.bump(-self.temp)
        return self.b(h) * self.scale


def tracker(devices=("cpu",), memory=None, **kw):
    events: list = []
    tr = PhaseTracker(torch, lambda k, p: events.append((k, p)), lambda: list(devices),
                      memory, **kw)
    labels: list = []
    orig = tr._boundary

    def spy(label, now=None):
        if label != tr._label:
            labels.append(label)
        orig(label, now)
    tr._boundary = spy
    tr.install_hooks()
    return tr, events, labels


def steps(events):
    return [p for k, p in events if k == "step"]


def breakdowns(events):
    return [p for k, p in events if k == "breakdown"]


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def state_bytes(opt) -> int:
    return sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
               if torch.is_tensor(v))
