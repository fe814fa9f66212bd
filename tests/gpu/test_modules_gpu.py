"""Per-module memory (gpumon/agent/modules.py) against torch's MemTracker on a real GPU: the
blog's loop with a Qwen2.5-1.5B-shaped model (a smaller config of the same architecture, so the
same code paths run: embeddings, GQA attention through SDPA, SwiGLU MLP, RMSNorm, the LM head
and the loss inside the model's forward; fp32 AdamW, foreach on CUDA), and one Hugging Face
Trainer run.

Run on the GPU machine:  python -m pytest tests/gpu/test_modules_gpu.py -v -s  (~1 min)
On CPU (the code paths, with tests/modules/cpu_alloc.py standing in for the allocator's
history): GPUMON_MODULES_CPU=1 python -m pytest tests/gpu/test_modules_gpu.py -v -s

What must hold, per module (MemTracker's figures: storages rounded up to 512 B on CUDA):
* parameters (children included) equal MemTracker's ``parameter_mem``, and to the byte the
  sums of the module's tensors; gradients and AdamW state to the byte against the tensors;
  the totals equal MemTracker's GRAD and OPT at its peak.
* activations: what each module's forward left allocated when it returned (``fwd_retained``)
  within 1% of MemTracker's ACT after minus before that forward (modules with >= 1 MiB).
* the module running at the peak is the one MemTracker's per-module peaks name (the innermost
  module whose forward or backward peak is the step's peak; none for a peak in the optimizer).
* the peak's parts add up to the allocator's figure, and torch's peak counter moved to it.
"""
from __future__ import annotations

import os
import sys

import pytest

torch = pytest.importorskip("torch")
CPU = os.environ.get("GPUMON_MODULES_CPU") == "1"
if not CPU and not torch.cuda.is_available():
    pytest.skip("needs CUDA (or GPUMON_MODULES_CPU=1)", allow_module_level=True)
transformers = pytest.importorskip("transformers")

from gpumon.agent import modules as M  # noqa: E402
from gpumon.model.modules import ModuleReport  # noqa: E402

DEV = "cpu" if CPU else "cuda"
MiB = 1 << 20


def _r512(n: int) -> int:
    return n if CPU else (0 if n == 0 else (n + 511) // 512 * 512)


def _config(layers=4, hidden=512, vocab=16000):
    # Qwen2.5-1.5B: hidden 1536, 28 layers, 12 heads, 2 KV heads, intermediate 8960,
    # vocab 151936, tied embeddings; the same shape at a fraction of the size
    C = transformers.Qwen2Config
    return C(hidden_size=hidden, intermediate_size=hidden * 3, num_hidden_layers=layers,
             num_attention_heads=8, num_key_value_heads=2, vocab_size=vocab,
             max_position_embeddings=1024, tie_word_embeddings=True,
             attn_implementation="sdpa")


def _sources(fake):
    if CPU:
        return dict(devices=lambda: [0], memory=fake, history=fake, tensor_device="cpu")
    from gpumon.agent.phases.memory import CudaMemory, TorchHistory
    return dict(devices=lambda: [torch.cuda.current_device()], memory=CudaMemory(torch),
                history=TorchHistory(torch), tensor_device="cuda")


def _state_bytes(opt):
    """AdamW's exp_avg and exp_avg_sq (8 bytes a parameter in fp32), and its step counters
    where they live on the device (fused/capturable; foreach keeps them on the CPU)."""
    return sum(v.numel() * v.element_size() for st in opt.state.values() for v in st.values()
               if isinstance(v, torch.Tensor) and v.device.type == DEV)


def _memtracker_step(model, opt, step):
    from torch.distributed._tools.mem_tracker import MemTracker
    mt = MemTracker()
    mt.track_external(model, opt)
    with mt:
        step()
    return mt


def _mt_dev(mt):
    for stats in mt.memory_tracking.values():
        for snaps in stats.snapshots.values():
            for snap in snaps:
                for d in snap:
                    if d.type == DEV:
                        return d
    raise AssertionError("MemTracker saw no tensor on the device")


def _mt_module_rows(mt, dev):
    """fqn without the root's class name -> (parameter_mem, act retained, peak total)."""
    from torch.distributed._tools.mem_tracker import _MemRefType, _ModState
    out = {}
    for stats in mt.memory_tracking.values():
        fqn = stats.mod_fqn
        path = fqn.split(".", 1)[1] if "." in fqn else ""
        pre = stats.snapshots.get(_ModState.PRE_FW) or []
        post = stats.snapshots.get(_ModState.POST_FW) or []
        act = None
        if len(pre) == 1 and len(post) == 1:
            act = post[0].get(dev, {}).get(_MemRefType.ACT, 0) - \
                pre[0].get(dev, {}).get(_MemRefType.ACT, 0)
        peak = 0
        for st in (_ModState.PEAK_FW, _ModState.PEAK_BW):
            for snap in stats.snapshots.get(st) or []:
                peak = max(peak, snap.get(dev, {}).get("Total", 0))
        out[path] = (stats.parameter_mem, act, peak)
    return out


def _check_against_memtracker(rep, mt, model, opt, label):
    dev = _mt_dev(mt)
    mt_rows = _mt_module_rows(mt, dev)
    inc = rep.inclusive()
    mods = dict(model.named_modules())
    owner = {}  # a tied parameter (embeddings and LM head) belongs to the first module
    for name, m in model.named_modules():
        for p in m.parameters(recurse=False):
            owner.setdefault(id(p), name)

    def inside(o, path):
        return path == "" or o == path or o.startswith(path + ".")
    checked = acts = 0
    worst = 0.0
    print(f"\n[{label}] peak {rep.peak} B in step {rep.peak_step}, {rep.peak_phase}, "
          f"stack {rep.peak_stack}; parts {rep.parts}")
    for path, (mt_params, mt_act, _) in sorted(mt_rows.items()):
        mod = mods.get(path)
        if mod is None or path not in inc:
            continue
        row = inc[path]
        params = list(mod.parameters())
        seen = set()
        shared = False
        exact_p = exact_g = exact_s = rounded = 0
        for p in params:
            if id(p) in seen:
                continue
            seen.add(id(p))
            if not inside(owner[id(p)], path):
                shared = True
                continue
            exact_p += p.numel() * p.element_size()
            rounded += _r512(p.untyped_storage().nbytes())
            if p.grad is not None:
                exact_g += p.grad.numel() * p.grad.element_size()
            for v in opt.state.get(p, {}).values():
                if isinstance(v, torch.Tensor) and v.device.type == DEV:
                    exact_s += v.numel() * v.element_size()
        assert row.params == exact_p, (path, row.params, exact_p)
        if not shared:  # MemTracker counts a tied parameter in both modules
            assert rounded == mt_params, (path, rounded, mt_params)
        assert row.optimizer_state == exact_s, (path, row.optimizer_state, exact_s)
        checked += 1
        if mt_act is not None and mt_act >= MiB and row.fwd_retained is not None:
            err = abs(row.fwd_retained - mt_act) / mt_act
            worst = max(worst, err)
            print(f"  {path or '(root)':<40} act {row.fwd_retained:>12} memtracker {mt_act:>12} "
                  f"({100 * err:.3f}%)")
            assert err <= 0.01, (path, row.fwd_retained, mt_act)
            acts += 1
    assert checked >= 10 and acts >= 5, (checked, acts)
    print(f"[{label}] {checked} modules' parameters and state to the byte; {acts} modules' "
          f"activations, worst {100 * worst:.3f}%")
    # the module at the peak: the innermost whose own peak is MemTracker's step peak
    gpeak = mt._peak_mem.get(dev, 0)
    at = [p for p, (_, _, pk) in mt_rows.items() if pk == gpeak]
    mt_mod = max(at, key=lambda p: (p.count(".") + (1 if p else 0), p)) if at else None
    ours = rep.peak_stack[-1] if rep.peak_stack else None
    print(f"[{label}] module at the peak: gpumon {ours!r} ({rep.peak_phase}), MemTracker "
          f"{mt_mod!r} (its peak {gpeak} B)")
    assert ours == mt_mod
    snap = mt.get_tracker_snapshot("peak").get(dev, {})
    print(f"[{label}] MemTracker at its peak: { {str(k): v for k, v in snap.items()} }")


def _loop(model, opt, batch, seq, vocab, gen):
    def step():
        ids = torch.randint(0, vocab, (batch, seq), device=DEV, generator=gen)
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return out.loss.item()
    return step


def test_blog_loop_against_memtracker():
    fake = None
    if CPU:
        sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
        from tests.modules.cpu_alloc import CpuAllocHistory
        fake = CpuAllocHistory()
        fake.__enter__()
    try:
        torch.manual_seed(0)
        layers, hidden, vocab = (2, 128, 4000) if CPU else (4, 512, 16000)
        batch, seq = (2, 64) if CPU else (8, 256)
        model = transformers.AutoModelForCausalLM.from_config(
            _config(layers, hidden, vocab)).to(DEV)
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        gen = torch.Generator(device=DEV).manual_seed(0)
        step = _loop(model, opt, batch, seq, vocab, gen)
        for _ in range(2):
            step()
        got: list = []
        M.start(1, done=got.append, torch_mod=torch, **_sources(fake))
        for _ in range(5):  # 2 timed before, 1 measured, 1 timed after, 1 spare
            step()
        assert got and got[0]["ok"], got
        r = got[0]
        assert r["exact"], r["note"]
        assert sum(r["at_peak"].values()) == r["peak"]
        rep = ModuleReport.from_result(r)
        print("\nstep time:", r["step_time_s"], "cost:", r["cost"])
        mt = _memtracker_step(model, opt, step)
        _check_against_memtracker(rep, mt, model, opt, "blog loop")
        # gradients: walked at the measured step's end (before zero_grad): 4 bytes a parameter
        n = sum(p.numel() for p in model.parameters())
        assert rep.inclusive()[""].grads == 4 * n and rep.inclusive()[""].params == 4 * n
        assert rep.inclusive()[""].optimizer_state == _state_bytes(opt)
    finally:
        M.uninstall()
        if fake is not None:
            fake.__exit__(None, None, None)


def test_trainer_run():
    pytest.importorskip("accelerate")
    from transformers import Trainer, TrainerCallback, TrainingArguments
    import tempfile

    fake = None
    if CPU:
        from tests.modules.cpu_alloc import CpuAllocHistory
        fake = CpuAllocHistory()
        fake.__enter__()
    try:
        torch.manual_seed(0)
        layers, hidden, vocab = (2, 128, 4000) if CPU else (4, 512, 16000)
        seq = 64 if CPU else 256
        model = transformers.AutoModelForCausalLM.from_config(_config(layers, hidden, vocab))

        class Data(torch.utils.data.Dataset):
            def __len__(self):
                return 64

            def __getitem__(self, i):
                g = torch.Generator().manual_seed(i)
                ids = torch.randint(0, vocab, (seq,), generator=g)
                return {"input_ids": ids, "labels": ids}

        got: list = []
        mts: list = []

        class Measure(TrainerCallback):
            """gpumon from step 2 (2 steps timed, then the measured one: step 5); MemTracker
            around step 7, the same shapes and code."""

            def on_step_begin(self, args, state, control, **kw):
                if state.global_step == 2:
                    M.start(1, done=got.append, torch_mod=torch, **_sources(fake))
                if state.global_step == 6:
                    from torch.distributed._tools.mem_tracker import MemTracker
                    opt = getattr(tr.optimizer, "optimizer", tr.optimizer)
                    mt = MemTracker()
                    mt.track_external(tr.model, opt)
                    mt.__enter__()
                    mts.append((mt, opt))

            def on_step_end(self, args, state, control, **kw):
                if mts and state.global_step == 7:
                    mts[0][0].__exit__(None, None, None)

        with tempfile.TemporaryDirectory() as out:
            targs = TrainingArguments(output_dir=out, per_device_train_batch_size=4,
                                      max_steps=9, report_to=[], save_strategy="no",
                                      logging_strategy="no", use_cpu=CPU,
                                      dataloader_num_workers=0)
            tr = Trainer(model=model, args=targs, train_dataset=Data(), callbacks=[Measure()])
            tr.train()
        assert got and got[0]["ok"], got
        r = got[0]
        assert r["exact"], r["note"]
        assert sum(r["at_peak"].values()) == r["peak"]
        rep = ModuleReport.from_result(r)
        n = sum(p.numel() for p in model.parameters())
        root = rep.inclusive()[""]
        assert root.params == 4 * n
        assert mts
        assert root.optimizer_state == _state_bytes(mts[0][1])
        assert any(row.path.startswith("model.layers.") for row in rep.rows)
        assert mts
        _check_against_memtracker(rep, mts[0][0], model, mts[0][1], "trainer")
        print("\n[trainer] peak", r["peak"], r["peak_phase"], r["peak_stack"], r["at_peak"],
              "step time", r["step_time_s"])
    finally:
        M.uninstall()
        if fake is not None:
            fake.__exit__(None, None, None)


@pytest.mark.skipif(CPU, reason="torch's own allocation history needs CUDA")
def test_snapshot_module_annotations_place_every_forward_allocation():
    """A real recording (python stacks, as `gpumon snapshot` makes it) with the sidecar's
    module annotations: each allocation a module's forward made is put in that module. The
    oracle: the test's own hooks on its own model read torch's allocation counter at every
    enter and leave; the k-th allocation of the trace is the counter's value at the
    recording's start plus k."""
    from gpumon.agent.modules import Annotator
    from gpumon.agent.phases.memory import CudaMemory
    from gpumon.snapshot.analysis import A_ALLOC, Snapshot
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_config(2, 256, 8000)).to(DEV)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator(device=DEV).manual_seed(0)
    step = _loop(model, opt, 4, 128, 8000, gen)
    step()
    step()
    dev = torch.cuda.current_device()

    def count():
        return torch.cuda.memory_stats(dev)["allocation.all.allocated"]
    names = {m: n for n, m in model.named_modules()}
    spans = []   # (path, count at enter, count at leave, depth)
    open_ = []

    def pre(m, a):
        if torch._C._current_graph_task_id() == -1:
            open_.append((names[m], count()))

    def post(m, a, o):
        if torch._C._current_graph_task_id() == -1 and open_:
            path, c0 = open_.pop()
            spans.append((path, c0, count(), len(open_)))
    hs = [m.register_forward_pre_hook(pre) for m in model.modules()]
    hs += [m.register_forward_hook(post) for m in model.modules()]
    ann = Annotator(torch, dev, CudaMemory(torch))
    try:
        torch.cuda.memory._record_memory_history(enabled="all", context="all",
                                                 stacks="python", max_entries=500_000)
        a0 = count()
        ann.start()
        step()
        ann.stop()
        snap = torch.cuda.memory._snapshot()
    finally:
        ann.stop()
        torch.cuda.memory._record_memory_history(enabled=None)
        for h in hs:
            h.remove()
    s = Snapshot(snap, "gpu.pickle", sidecar={"modules": ann.export()})
    tr = s.trace(dev)
    idx = tr.module_index
    assert idx is not None and idx.how == "counters", idx and idx.how
    checked = wrong = 0
    k = 0
    for i in range(tr.n):
        if tr.action[i] != A_ALLOC:
            continue
        k += 1
        v = a0 + k
        inside = [sp for sp in spans if sp[1] < v <= sp[2]]
        if not inside:
            continue
        want = max(inside, key=lambda sp: sp[3])[0]
        kind, stack = idx.context_at(i)
        checked += 1
        if kind != "forward" or not stack or stack[-1] != want:
            wrong += 1
    print(f"\n[snapshot] {checked} forward allocations checked, {wrong} misplaced; "
          f"{ann.export()['events'].count(';') + 1} module events")
    assert checked > 50 and wrong == 0
    groups = {g.key: g.bytes for g in tr.groups_at(tr.peak_index, by="module")}
    print("[snapshot] live at the peak by module:",
          sorted(groups.items(), key=lambda kv: -kv[1])[:6])
