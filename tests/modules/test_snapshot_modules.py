"""Module enter/leave in a snapshot's sidecar (gpumon/agent/modules.py's Annotator) and the
view's grouping by module (gpumon/snapshot/modules.py): every allocation a module's forward
made is put in that module, checked against an oracle that tags each allocation as it is
made."""
from __future__ import annotations

import torch

from gpumon.agent.modules import Annotator
from gpumon.snapshot import diff as D
from gpumon.snapshot.analysis import Snapshot
from tests.modules.cpu_alloc import CpuAllocHistory
from tests.modules.test_measure import Net, _train
from gpumon.snapshot.modules import decode_events


def _record(batch_scale: int = 1):
    fake = CpuAllocHistory()
    stack: list = []
    with fake:
        torch.manual_seed(0)
        model = Net()
        names = {m: n for n, m in model.named_modules()}
        opt = torch.optim.AdamW(model.parameters())
        _train(model, opt, 1)
        # the oracle: the test's own hooks on its own model
        hs = [m.register_forward_pre_hook(lambda m, a: stack.append(names[m]))
              for m in model.modules()]
        hs += [m.register_forward_hook(lambda m, a, o: (stack.pop(), None)[1])
               for m in model.modules()]
        fake.tagger = lambda: (stack[-1] if stack and not torch._C._current_graph_task_id()
                               != -1 else None)
        ann = Annotator(torch, 0, fake)
        fake.start()
        ann.start()
        _train(model, opt, 2)
        ann.stop()
        for h in hs:
            h.remove()
        data = {"segments": [], "device_traces": [list(fake.trace)],
                "allocator_settings": {}}
        side = {"modules": ann.export()}
    return Snapshot(data, "a.pickle", sidecar=side), fake


def test_every_forward_allocation_in_its_module():
    snap, fake = _record()
    tr = snap.trace(0)
    idx = tr.module_index
    assert idx is not None and idx.how == "counters"
    allocs = [i for i, e in enumerate(fake.trace) if e["action"] == "alloc"]
    assert len(allocs) == len(fake.tags)
    checked = 0
    for i, tag in zip(allocs, fake.tags):
        if tag is None:
            continue
        kind, stack = idx.context_at(i)
        assert kind == "forward" and stack[-1] == tag, (i, tag, kind, stack)
        checked += 1
    assert checked >= 10
    # the head's backward temporary is in the head's backward
    big = [i for i, e in enumerate(fake.trace) if e["action"] == "alloc"
           and e["size"] == 128 * 1024]
    assert big and all(idx.key_at(i) == "head [backward]" for i in big)


def test_group_by_module_and_diff():
    snap, _ = _record()
    tr = snap.trace(0)
    # at the head's backward temporary (the peak), the tanh outputs are live, in their modules
    groups = {g.key: g.bytes for g in tr.groups_at(tr.peak_index, by="module")}
    assert groups["head [backward]"] >= 128 * 1024
    assert groups["act1"] == groups["act2"] == 8 * 64 * 4
    d = D.diff(snap, snap)
    rows = d["by"]["module"]["rows"]
    assert {r["where"] for r in rows} >= {"act1", "act2", "head [backward]"}
    assert all(r["change"] == 0 for r in rows)
    assert "by module (nn.Module forward/backward)" in D.diff_text(d)


def test_recording_writes_module_annotations_into_the_sidecar(tmp_path):
    """gpumon's snapshot recorder (with the capture tests' stand-in for torch's recording
    API): module enter/leave logged while it records, in the sidecar; the pickle as torch
    writes it; no global hook left after the dump."""
    import json
    import pickle

    import torch.nn.modules.module as mm

    from gpumon.agent import snapshot as snap
    from tests.capture.fakes import FakeMemoryAPI
    api = FakeMemoryAPI()
    rec = snap.Recorder(None, backend=api, broadcast=lambda *a, **k: None, pid=1,
                        cwd=str(tmp_path), start_time=1_700_000_000.0, rank=None)
    n_hooks = (len(mm._global_forward_pre_hooks), len(mm._global_forward_hooks))
    torch.manual_seed(0)
    model = Net()
    rec.start({}, "pid:1")
    model(torch.randn(2, 32)).sum().backward()
    facts = rec.stop({}, "pid:1")
    assert (len(mm._global_forward_pre_hooks), len(mm._global_forward_hooks)) == n_hooks
    with open(facts["path"], "rb") as f:
        assert set(pickle.load(f)) == {"segments", "device_traces", "allocator_settings",
                                       "external_annotations"}
    ann = json.loads(open(facts["path"] + ".json").read())["modules"]
    assert {"", "inp", "act1", "mid", "act2", "out", "head"} <= set(ann["paths"])
    codes = [e[2] for e in decode_events(ann["events"])]
    assert codes.count(0) == codes.count(1) == 7  # every forward entered and left
    assert 2 in codes and 3 in codes and 4 in codes  # backward enter, leave, pass end


def test_events_string_round_trip_and_malformed_tail():
    snap, _ = _record()
    ann = snap.sidecar["modules"]
    evs = decode_events(ann["events"])
    assert len(evs) > 20 and all(c is not None for _t, c, _k, _p in evs)
    assert [e[0] for e in evs] == sorted(e[0] for e in evs)  # times rebuilt from differences
    assert decode_events(ann["events"] + ";1,2,x,0,1;5,1,1,0,0") == evs  # cut at the bad one
    assert decode_events("") == []
    # small enough that MAX_ANNOTATIONS events fit the sidecar reader's 16 MiB
    from gpumon.agent.modules import MAX_ANNOTATIONS
    assert len(ann["events"]) / len(evs) * MAX_ANNOTATIONS < 12 << 20


def test_placed_by_the_counters_when_the_clocks_differ_by_microseconds():
    """torch's trace clock and the agent's may differ by a few microseconds, in which several
    allocations can fall: the counters still place every event."""
    snap, fake = _record()
    ann = dict(snap.sidecar["modules"])
    first, rest = ann["events"].split(",", 1)
    times = sorted(e["time_us"] for e in fake.trace)
    gaps = sorted(b - a for a, b in zip(times, times[1:]) if b > a)
    step = gaps[len(gaps) // 2]  # this machine's typical time between two entries
    for skew in (-step - step // 2, step + step // 2):  # about an entry and a half off
        ann["events"] = f"{int(first) + skew},{rest}"
        s2 = Snapshot(snap.data, "b.pickle", sidecar={"modules": ann})
        idx = s2.trace(0).module_index
        assert idx.how == "counters"
        allocs = [i for i, e in enumerate(fake.trace) if e["action"] == "alloc"]
        for i, tag in zip(allocs, fake.tags):
            if tag is not None:
                assert idx.context_at(i)[1][-1] == tag
