"""Role accounting: exact byte sums on real CPU models and optimizers, dedup, device filter."""
import pytest
import torch

from gpumon.agent.phases import account, derive_roles

from .helpers import FakeMemory, Net, breakdowns, nbytes, state_bytes, tracker


def run(model, opt, n=2):
    for _ in range(n):
        model(torch.randn(2, 8)).sum().backward()
        opt.step()


OPTIMIZERS = {
    "adamw": lambda p: torch.optim.AdamW(p),
    "adamw_foreach_off": lambda p: torch.optim.AdamW(p, foreach=False),
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1),
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    "adafactor": lambda p: torch.optim.Adafactor(p),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_exact_bytes_per_role(name):
    m = Net()
    opt = OPTIMIZERS[name](m.parameters())
    run(m, opt)
    got, n = account([m], [opt], {"cpu"}, torch)
    params = nbytes(m.parameters()) + nbytes(m.buffers())
    grads = nbytes(p.grad for p in m.parameters())
    state = state_bytes(opt)
    assert got["cpu"] == {"parameters": params, "gradients": grads, "optimizer_state": state}
    if name == "sgd":
        assert state == 0
    if name == "sgd_momentum":
        assert state == nbytes(m.parameters())
    if name.startswith("adamw"):  # exp_avg + exp_avg_sq + a 4-byte step per parameter
        assert state == 2 * nbytes(m.parameters()) + 4 * len(list(m.parameters()))
    if name == "adafactor":  # factored: far less than one copy of the weights
        assert 0 < state < nbytes(m.parameters())


def test_gradients_none_after_zero_grad_and_frozen_params():
    m = Net()
    m.a.weight.requires_grad_(False)
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad])
    run(m, opt)
    got, _ = account([m], [opt], {"cpu"}, torch)
    trainable = [p for p in m.parameters() if p.requires_grad]
    assert got["cpu"]["gradients"] == nbytes(p.grad for p in trainable)
    assert got["cpu"]["optimizer_state"] == 2 * nbytes(trainable) + 4 * len(trainable)
    opt.zero_grad()  # set_to_none
    got, _ = account([m], [opt], {"cpu"}, torch)
    assert got["cpu"]["gradients"] == 0
    # the frozen weight still counts as a parameter
    assert got["cpu"]["parameters"] == nbytes(m.parameters()) + nbytes(m.buffers())


def test_shared_storage_is_counted_once():
    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(10, 6)
            self.head = torch.nn.Linear(6, 10, bias=False)
            self.head.weight = self.emb.weight  # tie_word_embeddings

        def forward(self, x):
            return self.head(self.emb(x))

    flat = torch.zeros(100)
    views = [torch.nn.Parameter(flat[:40].view(5, 8)), torch.nn.Parameter(flat[40:])]
    m = Tied()
    got, _ = account([m], [], {"cpu"}, torch)
    assert got["cpu"]["parameters"] == 10 * 6 * 4
    # parameters viewing one flat buffer (FSDP-style): the storage once, at full size
    opt = torch.optim.SGD(views, lr=0.1)
    got, _ = account([], [opt], {"cpu"}, torch)
    assert got["cpu"]["parameters"] == 100 * 4
    # same module given twice, and through the optimizer too: no double count
    opt2 = torch.optim.SGD(m.parameters(), lr=0.1)
    got, _ = account([m, m], [opt2], {"cpu"}, torch)
    assert got["cpu"]["parameters"] == 10 * 6 * 4


def test_device_filter():
    m = Net()
    opt = torch.optim.AdamW(m.parameters())
    run(m, opt, 1)
    got, _ = account([m], [opt], {0}, torch)  # only cuda:0: nothing of a CPU model
    assert got == {}
    got, _ = account([m], [opt], None, torch)  # no filter: every device
    assert got["cpu"]["parameters"] > 0
    meta = torch.nn.Linear(4, 4, device="meta")
    got, _ = account([meta], [], None, torch)
    assert got == {}  # meta tensors hold no memory


def test_two_optimizers_over_one_model():
    m = Net()
    o1 = torch.optim.AdamW(m.a.parameters())
    o2 = torch.optim.SGD(m.b.parameters(), lr=0.1, momentum=0.9)
    for _ in range(2):
        m(torch.randn(2, 8)).sum().backward()
        o1.step()
        o2.step()
    got, _ = account([m], [o1, o2], {"cpu"}, torch)
    assert got["cpu"]["optimizer_state"] == state_bytes(o1) + state_bytes(o2)
    assert got["cpu"]["optimizer_state"] == (2 * nbytes(m.a.parameters()) + 4 * 2
                                             + nbytes(m.b.parameters()))


def test_derive_roles():
    r = derive_roles({"parameters": 100, "gradients": 50, "optimizer_state": 200},
                     allocated=1000, reserved=1500, nvml_used=2000)
    assert r == {"parameters": 100, "gradients": 50, "optimizer_state": 200,
                 "activations": 650, "allocator_cache": 500, "non_pytorch": 500}
    r = derive_roles(None, None, None, None)
    assert r["activations"] is None and r["allocator_cache"] is None and r["non_pytorch"] is None


def test_breakdown_events_through_the_tracker_with_fake_allocator():
    mem = FakeMemory(base=0)
    tr, ev, labels = tracker(devices=("cpu",), memory=mem)
    try:
        m = Net(mem, act=10_000)
        opt = torch.optim.AdamW(m.parameters())
        pbytes = nbytes(m.parameters()) + nbytes(m.buffers())
        mem.bump(pbytes)  # the fake allocator holds the parameters
        # the optimizer's first step allocates its state (exp_avg, exp_avg_sq) and a temporary
        sbytes = 2 * nbytes(m.parameters()) + 4 * len(list(m.parameters()))

        def pre(o, a, k):
            if not o.state:
                mem.bump(sbytes)
            mem.bump(777)

        def post(o, a, k):
            mem.bump(-777)
        h1 = opt.register_step_pre_hook(pre)
        h2 = opt.register_step_post_hook(post)
        gbytes = nbytes(m.parameters())
        for _ in range(2):
            out = m(torch.randn(2, 8)).sum()
            out.backward()
            mem.bump(gbytes) if mem.cur < pbytes + sbytes + gbytes else None
            opt.step()
            opt.zero_grad()
            mem.bump(-gbytes)
        tr.mark("end")
        h1.remove()
        h2.remove()
        bds = breakdowns(ev)
        after_opt = [b for b in bds if b["phase"] == "optimizer"]
        d = after_opt[-1]["devices"][0]
        assert d["index"] == "cpu"
        assert d["now"]["parameters"] == pbytes
        assert d["now"]["optimizer_state"] == sbytes
        assert d["now"]["gradients"] == gbytes
        assert d["now"]["activations"] == d["allocated"] - pbytes - sbytes - gbytes
        assert d["now"]["allocator_cache"] == d["reserved"] - d["allocated"]
        last = bds[-1]["devices"][0]
        # at the last completed step's peak: the roles at the end of its peak phase
        assert last["peak_phase"] in ("forward", "optimizer")
        at = last["at_peak"]
        assert at is not None
        assert sum(at[k] for k in ("parameters", "gradients", "optimizer_state",
                                   "activations")) == last["peak"]
    finally:
        tr.close()
