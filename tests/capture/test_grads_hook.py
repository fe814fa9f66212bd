"""The grads note (gpumon/agent/grads.py) inside a real torch training loop (CPU): the program's
results are bit-for-bit the same with and without it, its objects still copy and pickle, and
what it notes is each param.grad's address and size at the optimizer step (issue 33)."""
import copy
import pickle
import sys

import pytest

torch = pytest.importorskip("torch")

from gpumon.agent.grads import GradLog  # noqa: E402


def _train(log: GradLog | None):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mod = sys.modules[torch.optim.Optimizer.__module__]
    seen = []
    handle = mod.register_optimizer_step_pre_hook(log.on_step_pre) if log else None
    try:
        for _ in range(3):
            loss = model(torch.randn(8, 16)).square().mean()
            loss.backward()
            seen.append([(p.grad.data_ptr(), p.grad.nbytes) for p in model.parameters()])
            opt.step()
            opt.zero_grad(set_to_none=True)
        copy.deepcopy(model), copy.deepcopy(opt)
        pickle.dumps((model.state_dict(), opt.state_dict()))
    finally:
        if handle is not None:
            handle.remove()
    return [p.detach().clone() for p in model.parameters()], seen


def test_same_results_with_and_without_the_grads_note():
    without, _ = _train(None)
    log = GradLog(device_type="cpu")
    with_, seen = _train(log)
    assert all(torch.equal(a, b) for a, b in zip(without, with_))
    d = log.export()
    assert len(d["steps"]) == 3
    for step, want in zip(d["steps"], seen):
        assert list(zip(step["ptr"], step["size"])) == want
    assert len(d["names"]) == 4  # one name per parameter, kept across steps
