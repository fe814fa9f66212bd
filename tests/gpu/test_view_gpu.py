"""`gpumon view` on real snapshots recorded with stacks='all' (skipped without CUDA).

Run on the GPU machine:  python -m pytest tests/gpu/test_view_gpu.py -q -s
Checks what issue 18 found on H200 files: no group is named by torch's unwinder, gradients
made by autograd's thread are named by their autograd node, shown stacks open past the
unwinder and allocator, the reserved timeline ends at memory_reserved() and never passes
max_memory_reserved(), and the segments rebuilt at the end are the dump's.
"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from gpumon.snapshot import open_snapshot, report  # noqa: E402


def _record(path, stacks):
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(max_entries=200_000, stacks=stacks)
    try:
        model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(1024, 1024),
                                      torch.nn.GELU()) for _ in range(4)]).cuda()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        x = torch.randn(256, 1024, device="cuda")
        for _ in range(4):
            opt.zero_grad(set_to_none=True)
            model(x).square().mean().backward()
            opt.step()
        torch.cuda.synchronize()
        torch.cuda.memory._dump_snapshot(str(path))
        reserved, peak_reserved = torch.cuda.memory_reserved(), torch.cuda.max_memory_reserved()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    return reserved, peak_reserved


def test_all_stacks_snapshot(tmp_path):
    f = tmp_path / "all.pickle"
    reserved, peak_reserved = _record(f, "all")
    snap = open_snapshot(f)
    tr = snap.trace()
    keys = [g.key for g in tr.groups_at(tr.peak_index)]
    print("groups at the peak:", keys[:12])
    assert not any("unwind" in k or "CapturedTraceback" in k for k in keys)
    assert any(k.startswith("<autograd ") for k in keys) or any(".py:" in k for k in keys)
    for g in tr.groups_at(tr.peak_index)[:10]:
        if g.elements and tr.el_fid[g.elements[0]]:
            fr = tr.shown_frames(tr.el_fid[g.elements[0]])
            assert fr and "unwind" not in fr[0][2] and "CachingAllocator" not in fr[0][2]
    assert tr.reserved[-1] == reserved
    assert tr.peak_reserved[0] <= peak_reserved
    assert tr.segments_at(tr.n - 1) == tr.segment_infos()
    s = report.summary(snap)
    txt = report.summary_text(s)
    print(txt)
    assert "unwind" not in txt


def test_python_stacks_snapshot_groups_the_same_places(tmp_path):
    f = tmp_path / "py.pickle"
    _record(f, "python")
    tr = open_snapshot(f).trace()
    keys = [g.key for g in tr.groups_at(tr.peak_index)]
    print("groups at the peak:", keys[:12])
    assert "<no stack recorded>" in keys or any(".py:" in k for k in keys)
