"""The per-module measurement (gpumon/agent/modules.py) on a CPU program whose every storage a
stand-in allocator sees (cpu_alloc.py): the figures are checked against what the model's
shapes and autograd's saved tensors say, to the byte."""
from __future__ import annotations

import copy
import pickle

import pytest
import torch

from gpumon.agent import modules as M
from gpumon.model.modules import PEAK_PARTS, ModuleReport, render
from tests.modules.cpu_alloc import CpuAllocHistory, r512

B, D, H, O = 8, 32, 64, 16
BIG_BWD = 128 * 1024   # bytes the head's backward allocates for a moment


class _BigBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 1.0

    @staticmethod
    def backward(ctx, g):
        tmp = torch.ones(BIG_BWD // 4)          # a backward transient: the step's peak
        return g * tmp[0]


class Head(torch.nn.Module):
    def forward(self, x):
        return _BigBackward.apply(x)


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(D, H)
        self.act1 = torch.nn.Tanh()
        self.mid = torch.nn.Linear(H, H, bias=False)
        self.act2 = torch.nn.Tanh()
        self.out = torch.nn.Linear(H, O)
        self.head = Head()
        self.register_buffer("scale", torch.ones(O))

    def forward(self, x):
        h = self.act2(self.mid(self.act1(self.inp(x))))
        return self.head(x=self.out(h)) * self.scale  # by keyword, as HF modules are called


def _train(model, opt, steps, seed=1, on_step=None):
    g = torch.Generator().manual_seed(seed)
    losses = []
    for i in range(steps):
        if on_step is not None:
            on_step(i)
        x = torch.randn(B, D, generator=g)
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _measure(steps=1, program_steps=7, seed=1):
    torch.manual_seed(0)
    fake = CpuAllocHistory()
    got: list = []
    with fake:
        model = Net()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        truth_at: dict = {}

        def on_step(i):
            truth_at[i] = len(fake.truth)
            if i == 0:
                M.start(steps, done=got.append, torch_mod=torch, devices=lambda: [0],
                        memory=fake, history=fake, tensor_device="cpu")
        losses = _train(model, opt, program_steps, seed, on_step)
    return model, opt, fake, got, losses, truth_at


@pytest.fixture(autouse=True)
def _reset():
    yield
    M.uninstall()
    M._current = None


def test_persistent_parts_per_module_to_the_byte():
    model, opt, fake, got, _, _ = _measure()
    assert len(got) == 1 and got[0]["ok"], got
    rows = {m["path"]: m for m in got[0]["modules"]}
    f = 4  # fp32
    for path, lin in (("inp", model.inp), ("mid", model.mid), ("out", model.out)):
        n = sum(p.numel() for p in lin.parameters())
        assert rows[path]["params"] == n * f
        assert rows[path]["grads"] == n * f  # walked at the optimizer step's end
        # AdamW: exp_avg and exp_avg_sq per parameter, plus its 0-dim fp32 step counter
        assert rows[path]["optimizer_state"] == 2 * n * f + 4 * len(list(lin.parameters()))
    assert rows[""]["buffers"] == O * f and rows[""]["params"] == 0
    assert rows["act1"]["params"] == 0 and rows["act1"]["type"] == "Tanh"
    assert all(r["calls"] == 1 for r in got[0]["modules"])


def test_peak_parts_add_up_and_name_the_module_running():
    _, _, fake, got, _, truth_at = _measure()
    r = got[0]
    # measured step: the program's third (two baseline steps before it)
    truth = fake.truth[truth_at[2]:truth_at[3]]
    assert r["peak"] == max(truth)
    assert sum(r["at_peak"].values()) == r["peak"] and r["exact"]
    assert set(r["at_peak"]) == set(PEAK_PARTS)
    assert r["peak_phase"] == "backward" and r["peak_stack"][-1] == "head"
    rows = {m["path"]: m for m in r["modules"]}
    # the head's backward made a BIG_BWD temporary (and g * tmp[0]'s result, a 0-dim view read)
    assert rows["head"]["bwd_transient"] >= BIG_BWD
    assert rows["head"]["bwd_at_peak"] >= BIG_BWD
    # at a peak in the head's backward, every other module's backward is still to come
    assert rows["act1"]["bwd_at_peak"] == 0 and rows["inp"]["bwd_at_peak"] == 0


def test_activations_equal_the_saved_tensors():
    """Each Tanh saves its output (and the next Linear saves the same tensor as its input):
    those are the activations the module's forward made and that are live at a peak in the
    first backward op. A Linear's output is not saved (tanh saves its result, not its input)
    and is gone when its forward's caller moves on. The oracle: autograd's own pack hook."""
    torch.manual_seed(0)
    saved: dict = {}
    stack: list = []
    model = Net()
    names = {m: n for n, m in model.named_modules()}
    hs = [m.register_forward_pre_hook(lambda m, a: stack.append(names[m]))
          for m in model.modules()]
    hs += [m.register_forward_hook(lambda m, a, o: (stack.pop(), None)[1])
           for m in model.modules()]

    def pack(t):
        st = t.untyped_storage()
        saved.setdefault(stack[-1] if stack else None, {})[st.data_ptr()] = st.nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(torch.randn(B, D)).pow(2).mean().backward()
    for h in hs:
        h.remove()
    oracle = {k: sum(v.values()) for k, v in saved.items()}
    assert oracle["act1"] == B * H * 4 and oracle["act2"] == B * H * 4

    _, _, _, got, _, _ = _measure()
    rows = {m["path"]: m for m in got[0]["modules"]}
    assert rows["act1"]["act_at_peak"] == r512(oracle["act1"])
    assert rows["act2"]["act_at_peak"] == r512(oracle["act2"])
    assert rows["inp"]["act_at_peak"] == 0 and rows["mid"]["act_at_peak"] == 0
    # what each forward left allocated when it returned (MemTracker's per-module activations)
    assert rows["inp"]["fwd_retained"] == B * H * 4      # its output, until tanh ran
    assert rows["act1"]["fwd_retained"] == B * H * 4
    assert rows["out"]["fwd_retained"] == B * O * 4
    assert rows[""]["fwd_retained"] >= 2 * B * H * 4 + B * O * 4


def test_nothing_stays_same_losses_and_copies():
    torch.manual_seed(0)
    plain_model = Net()
    plain = _train(plain_model, torch.optim.AdamW(plain_model.parameters(), lr=1e-3), 8)
    import torch.nn.modules.module as mm
    import torch.optim.optimizer as oo
    before = (dict(mm._global_forward_pre_hooks), dict(mm._global_forward_hooks),
              dict(oo._global_optimizer_pre_hooks), dict(oo._global_optimizer_post_hooks),
              dict(mm._global_forward_hooks_with_kwargs),
              dict(mm._global_forward_hooks_always_called), bool(mm._has_any_global_hook()))
    # 2 steps timed, 2 measured, 1 timed after; the last hooks go at the next module call
    model, opt, _, got, losses, _ = _measure(steps=2, program_steps=8)
    assert got and got[0]["ok"]
    assert losses == plain  # bit for bit
    # (torch's handle leaves a with_kwargs hook's flag behind: gpumon must take it too, or
    # every module call of the program takes the slow path for ever after)
    after = (dict(mm._global_forward_pre_hooks), dict(mm._global_forward_hooks),
             dict(oo._global_optimizer_pre_hooks), dict(oo._global_optimizer_post_hooks),
             dict(mm._global_forward_hooks_with_kwargs),
             dict(mm._global_forward_hooks_always_called), bool(mm._has_any_global_hook()))
    assert after == before
    for m in model.modules():
        assert not m._forward_hooks and not m._forward_pre_hooks
        assert not m._backward_hooks and not m._backward_pre_hooks
    clone = copy.deepcopy(model)
    pickle.loads(pickle.dumps(model))
    x = torch.randn(2, D)
    assert torch.equal(clone(x), model(x))


def test_step_times_and_cost_are_reported():
    _, _, _, got, _, _ = _measure(steps=2)
    st = got[0]["step_time_s"]
    assert st["before"] > 0 and st["after"] > 0 and len(st["measured"]) == 2
    assert got[0]["cost"]["hook_calls"] > 0 and got[0]["cost"]["entries"] > 0


def test_without_history_persistent_parts_only():
    torch.manual_seed(0)
    got: list = []
    model = Net()
    opt = torch.optim.AdamW(model.parameters())
    M.start(1, done=got.append, torch_mod=torch, devices=lambda: ["cpu"],
            memory=M._sources(torch)[1], history=None, tensor_device="cpu")
    _train(model, opt, 5)
    r = got[0]
    assert r["ok"] and not r["exact"] and r["peak"] is None and "no allocation history" in r["note"]
    rows = {m["path"]: m for m in r["modules"]}
    assert rows["inp"]["params"] == (D * H + H) * 4


def test_one_at_a_time_and_cancel():
    fake = CpuAllocHistory()
    import torch.optim.optimizer as oo
    n_post = len(oo._global_optimizer_post_hooks)
    M.start(1, torch_mod=torch, devices=lambda: [0], memory=fake, history=fake,
            tensor_device="cpu")
    with pytest.raises(RuntimeError, match="already in progress"):
        M.start(1, torch_mod=torch, devices=lambda: [0], memory=fake, history=fake)
    assert M.cancel()
    # the agent's thread only asks: the training thread ends it at its next hook
    model = Net()
    _train(model, torch.optim.SGD(model.parameters(), lr=0.1), 2)
    assert M.status()["state"] == "idle" and M.status()["last"]["error"] == "cancelled"
    assert len(oo._global_optimizer_post_hooks) == n_post


def test_hooks_removed_while_torch_iterates_them():
    """A global optimizer post-hook registered after ours (MemTracker, a user's): removing
    ours from inside torch's loop over that dict would raise in the program."""
    import torch.optim.optimizer as oo
    import torch.nn.modules.module as mm
    n = (len(oo._global_optimizer_pre_hooks), len(oo._global_optimizer_post_hooks),
         len(mm._global_forward_pre_hooks))
    got: list = []
    fake = CpuAllocHistory()
    calls = []
    with fake:
        torch.manual_seed(0)
        model = Net()
        opt = torch.optim.AdamW(model.parameters())
        M.start(1, done=got.append, torch_mod=torch, devices=lambda: [0], memory=fake,
                history=fake, tensor_device="cpu")
        later = oo.register_optimizer_step_post_hook(lambda o, a, k: calls.append(1))
        try:
            _train(model, opt, 7)
        finally:
            later.remove()
    assert got and got[0]["ok"] and len(calls) == 7
    assert (len(oo._global_optimizer_pre_hooks), len(oo._global_optimizer_post_hooks),
            len(mm._global_forward_pre_hooks)) == n


def test_compiled_model_measured_as_one_module_without_recompiling():
    import torch._dynamo
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    fake = CpuAllocHistory()
    got: list = []
    with fake:
        model = Net()
        cmodel = torch.compile(model, backend="aot_eager")
        opt = torch.optim.AdamW(model.parameters())
        _train(cmodel, opt, 2)
        frames = dict(counters["frames"])
        M.start(1, done=got.append, torch_mod=torch, devices=lambda: [0], memory=fake,
                history=fake, tensor_device="cpu")
        import warnings
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            _train(cmodel, opt, 6)
    # torch warns that global hooks fire twice around a compiled module: gpumon's count it
    # once, so the program's stderr stays its own
    assert not [x for x in w if "global hooks" in str(x.message)]
    import torch.nn.modules.module as mm
    assert mm._has_any_global_hook.__module__ == "torch.nn.modules.module"  # put back
    assert dict(counters["frames"]) == frames  # no new frame compiled: no recompile, no break
    r = got[0]
    assert r["ok"] and r["compiled"] == [""] and r["exact"]
    paths = {m["path"] for m in r["modules"]}
    assert {"", "inp", "out"} <= paths  # parameters named by the inner tree
    called = {m["path"] for m in r["modules"] if m["calls"]}
    assert called == {""}  # only the compiled module ran hooks


def test_report_renders_tree_and_top():
    _, _, _, got, _, _ = _measure()
    rep = ModuleReport.from_result(got[0])
    inc = rep.inclusive()
    assert inc[""].params == sum(r.params for r in rep.rows)
    assert [r.path for r in rep.top(2)][0] in ("inp", "head", "mid")
    text = render(rep, depth=1, top=3)
    assert "running: (root) > head" in text
    assert "(root) (Net)" in text and "  inp (Linear)" in text
    assert rep.peak_module() == "head"
