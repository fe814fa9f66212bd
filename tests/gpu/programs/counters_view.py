"""A training program that reads torch's peak counters at many points and resets them itself
(issue 35): run plainly and with gpumon (tests/gpu/test_counters_gpu.py), it must print the
same lines. It never imports gpumon (``start_if_asked``: only in the gpumon.start() mode).

    python tests/gpu/programs/counters_view.py --device cuda [--steps 12]
    python tests/gpu/programs/counters_view.py --device fake   # CPU: torch's readers on the
        fake CUDA allocator of tests/phases/fake_cuda.py, which the program's own tensors drive

Every probe prints one line: where it is (step, point), then what torch's Python API says:
max_memory_allocated/reserved, memory_allocated, every ``.peak`` of memory_stats(), the nested
dict's active peak, torch.cuda.memory.* and (CUDA, torch >= 2.9) torch.accelerator.*; some
probes print memory_summary() too. Probes run after forward, after backward, after the
optimizer step and at the end of each step, and in the middle of each phase (inside the
model's forward, in a tensor hook during backward, in the optimizer's own step hooks). The
program resets the peaks itself: reset_peak_memory_stats after a backward, in the middle of a
forward, inside an optimizer step, reset_max_memory_allocated at the end of a step, and (CUDA,
torch >= 2.9) torch.accelerator.reset_peak_memory_stats after a backward.
"""
from __future__ import annotations

import argparse
import gc
import json
import warnings

from program_env import fake_cuda, start_if_asked, wait_if_asked  # (no gpumon)

import torch

ap = argparse.ArgumentParser()
ap.add_argument("--device", choices=("cuda", "fake"), default="cuda")
ap.add_argument("--steps", type=int, default=12)
ap.add_argument("--reference", action="store_true",
                help="torch's own peak of every span between two probes: reset after each "
                     "probe, none of the program's own resets (a plain run, for the test)")
args = ap.parse_args()
REFERENCE = args.reference
FAKE = args.device == "fake"
dev = "cpu" if FAKE else "cuda"
mem = None
SCALE = 4000  # fake mode: a CPU tensor of n bytes is n * SCALE fake device bytes
cuda = torch.cuda
acc = getattr(torch, "accelerator", None)
ACC = (not FAKE and acc is not None and hasattr(acc, "max_memory_allocated")
       and hasattr(acc, "memory_stats") and hasattr(acc, "reset_peak_memory_stats"))


def probe(where: str, summary: bool = False) -> None:
    s = cuda.memory_stats()
    line = {"at": where, "max_alloc": cuda.max_memory_allocated(),
            "max_reserved": cuda.max_memory_reserved(), "alloc": cuda.memory_allocated(),
            "reserved": cuda.memory_reserved(),
            "peaks": {k: v for k, v in sorted(s.items()) if k.endswith(".peak")},
            "nested_active_peak": cuda.memory_stats_as_nested_dict()["active_bytes"]["all"]["peak"],
            "memory_max_alloc_0": torch.cuda.memory.max_memory_allocated(0)}
    if ACC:
        line["acc_max_alloc"] = acc.max_memory_allocated()
        line["acc_peaks"] = {k: v for k, v in sorted(acc.memory_stats().items())
                             if k.endswith(".peak")}
    print("PROBE " + json.dumps(line), flush=True)
    if REFERENCE:
        cuda.reset_peak_memory_stats()
    if summary:
        for row in cuda.memory_summary().splitlines():
            print("SUMMARY| " + row)


def reset(where: str, api=None) -> None:
    if REFERENCE:
        return
    (api or cuda).reset_peak_memory_stats()
    print(f"RESET {where}", flush=True)
    probe(f"{where}/after reset")


# ---- the fake mode's device memory, driven by the program's own tensors ---------------------
class Mirror(torch.autograd.Function):
    """Fake mode: an identity that holds device bytes for its input (a saved activation),
    freed in backward, where it also makes the gradient of its layer (kept until zero_grad)
    and a transient."""

    @staticmethod
    def forward(ctx, x, layer):
        ctx.layer = layer
        ctx.ptr = mem.malloc(x.nbytes * SCALE)
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        layer = ctx.layer
        if layer not in grads:
            grads[layer] = mem.malloc(sum(p.nbytes for p in layer.parameters()) * SCALE)
        t = mem.malloc(g.nbytes * SCALE)
        mem.free(t)
        mem.free(ctx.ptr)
        return g, None


grads: dict = {}


class Net(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.l1 = torch.nn.Linear(256, width)
        self.l2 = torch.nn.Linear(width, width)
        self.l3 = torch.nn.Linear(width, 16)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        h = torch.nn.functional.gelu(self.l1(x))
        if FAKE:
            h = Mirror.apply(h, self.l1)
        probe(f"call {self.calls}/mid {'forward' if self.training else 'eval'}")
        if self.calls == 5:
            reset(f"call {self.calls}/mid forward")  # the program resets inside a phase
        h = torch.nn.functional.gelu(self.l2(h))
        if FAKE:
            h = Mirror.apply(h, self.l2)
        if self.training:
            h.register_hook(lambda g: probe(f"call {self.calls}/mid backward"))
        out = self.l3(h)
        return Mirror.apply(out, self.l3) if FAKE else out


torch.manual_seed(0)
model = Net(128 if FAKE else 4096).to(dev)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
state: list = []
tmp: list = []


def step_pre(o, a, k):
    if FAKE:
        if not state:
            state.append(mem.malloc(2 * sum(p.nbytes for p in model.parameters()) * SCALE))
        tmp.append(mem.malloc(sum(p.nbytes for p in model.parameters()) * SCALE))
    probe(f"step {n_step}/mid optimizer")
    if n_step == 9:
        reset(f"step {n_step}/mid optimizer")


def step_post(o, a, k):
    if FAKE:
        mem.free(tmp.pop())
    probe(f"step {n_step}/optimizer end (hook)")


opt.register_step_pre_hook(step_pre)
opt.register_step_post_hook(step_post)

# batches of three sizes: the small ones' steps peak in the optimizer step, the large ones'
# in forward or backward (activations)
batches = [(torch.randn(b, 256, device=dev), torch.randint(0, 16, (b,), device=dev))
           for b in ((16, 512, 128) if FAKE else (64, 2048, 512))]
xe = torch.randn(8, 256, device=dev)
if FAKE:
    mem, fake_ctx = fake_cuda(torch)  # after torch's own set-up
    params = mem.malloc(sum(p.nbytes for p in model.parameters()) * SCALE)
probe("start", summary=True)
start_if_asked()   # gpumon.start() in that mode (after CUDA is up: the torch source follows it)
wait_if_asked()    # a test's client connects meanwhile
gc.disable()       # frees happen where the code says, the same with and without gpumon
gc.freeze()        # (and gc.collect() at each step costs little)
n_step = 0
for n_step in range(1, args.steps + 1):
    gc.collect()
    probe(f"step {n_step}/start")
    x, y = batches[n_step % 3]
    loss = torch.nn.functional.cross_entropy(model(x), y)
    probe(f"step {n_step}/after forward")
    loss.backward()
    probe(f"step {n_step}/after backward", summary=n_step in (2, 7))
    if n_step == 3:
        reset(f"step {n_step}/after backward")
    if n_step == 11 and ACC:  # torch.accelerator's own entry points (torch >= 2.9, CUDA)
        reset(f"step {n_step}/after backward (torch.accelerator)", api=acc)
    del loss
    opt.step()
    probe(f"step {n_step}/after step", summary=n_step in (1, 8))
    opt.zero_grad(set_to_none=True)
    if FAKE:
        for p in grads.values():
            mem.free(p)
        grads.clear()
    if n_step == 6 and not REFERENCE:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cuda.reset_max_memory_allocated()  # deprecated: the same reset, with a warning
        print(f"RESET step {n_step}/reset_max_memory_allocated "
              f"({[w.category.__name__ for w in caught]})", flush=True)
    if n_step == 10:
        model.eval()
        with torch.no_grad():
            model(xe)  # an eval pass inside a step
        model.train()
        probe(f"step {n_step}/after eval")
    probe(f"step {n_step}/end", summary=n_step == args.steps)
gc.enable()
# one more forward closes the last step for gpumon (its step ends at the next hook)
model.eval()
with torch.no_grad():
    model(xe)
probe("final", summary=True)
print("DONE", flush=True)
wait_if_asked(".end")  # the test reads gpumon's steps before the program ends
if FAKE:
    fake_ctx.__exit__(None, None, None)  # torch's readers as they were, before shutdown
gc.unfreeze()  # what gc.freeze() kept is freed at exit again: torch 2.15's triton 3.9 (nanobind)
#                 otherwise reports its objects leaked on stderr, a different text each run
