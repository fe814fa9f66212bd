"""Which agents of a process tree are followed: torchrun (or accelerate) under `gpumon run` has
an agent that never sees CUDA, and so have the workers a rank spawns (DataLoader with spawn,
datasets.map, compile workers): neither is shown as a process of its own; ranks are."""
import pytest

from gpumon.client import discovery, target

# 1: torchrun (no RANK); 2, 3: its ranks (RANK set); 4: a worker of rank 2 (inherits RANK);
# 5: a worker of a single process 6 (neither has a rank)
PARENT = {2: 1, 3: 1, 4: 2, 5: 6}
RANKED = {2, 3, 4}


@pytest.fixture(autouse=True)
def tree(monkeypatch):
    def ancestors(pid, limit=64):
        out = set()
        while pid in PARENT:
            pid = PARENT[pid]
            out.add(pid)
        return out
    monkeypatch.setattr(target, "_ancestors", ancestors)
    monkeypatch.setattr(target, "_has_rank", lambda pid: pid in RANKED)


def found(**states):
    return {int(k[1:]): discovery.Found(int(k[1:]), v, None) for k, v in states.items()}


@pytest.mark.parametrize("states,shown", [
    # everyone waits for CUDA: the ranks (not torchrun, not rank 2's worker)
    (dict(p1="waiting", p2="waiting", p3="waiting", p4="waiting"), {2, 3}),
    # one rank serves: the other rank still waits and is shown
    (dict(p1="waiting", p2="serving", p3="waiting", p4="waiting"), {2, 3}),
    # a single process and its worker, both waiting: the process
    (dict(p5="waiting", p6="waiting"), {6}),
    # a worker that uses CUDA serves: shown
    (dict(p2="serving", p4="serving"), {2, 4}),
    # torchrun alone (its ranks not started yet): it is what there is
    (dict(p1="waiting"), {1}),
])
def test_visible(states, shown):
    f = found(**states)
    assert target._visible(set(f), f) == shown
