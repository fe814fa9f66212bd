"""`gpumon view`'s "allocated" peak as torch counts it (blocks) against torch's own counters on a
real GPU (issue 17; skipped without CUDA).

Run on the GPU machine:  python -m pytest tests/gpu/test_view_blocks_gpu.py -q -s
The history starts with the peak counter reset and whatever earlier tests left live (blocks
the replay counts from the dump, as a recording started mid-run has them), so the block
replay must end at torch.cuda.memory_allocated() and peak at torch.cuda.max_memory_allocated(),
to the byte, with requests chosen to leave unsplit remainders (a large block cut from a free
block whose rest would be 1 MiB or less keeps it whole).
"""
from __future__ import annotations

import gc

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from gpumon.snapshot import open_snapshot, report  # noqa: E402

MiB = 1 << 20


def _workload():
    keep = []
    # 1-10 MiB requests get a 20 MiB segment: 9.5 MiB splits it, 10.2 MiB then leaves 0.3 MiB
    a = torch.empty(int(9.5 * MiB), dtype=torch.uint8, device="cuda")
    b = torch.empty(int(10.2 * MiB), dtype=torch.uint8, device="cuda")
    keep += [a, b]
    odd = [torch.empty(int(k * MiB + 12345), dtype=torch.uint8, device="cuda")
           for k in (1.1, 2.7, 3.3, 5.9, 7.7)]
    del odd[1], odd[2]
    keep += odd
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(1000, 1000),
                                  torch.nn.GELU()) for _ in range(4)]).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(300, 1000, device="cuda")
    for _ in range(3):
        opt.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        opt.step()
    del keep[0]
    torch.cuda.synchronize()
    return keep, model, opt


@pytest.mark.parametrize("stacks", ["python", "all"])
def test_block_peak_is_torchs_max_memory_allocated(tmp_path, stacks):
    # the first matmul of the process allocates cuBLAS's workspaces through the caching allocator
    # and keeps them (on the H100 the second case found 65 MiB live): torch's own leak check
    # clears them the same way before it counts
    gc.collect()
    torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.empty_cache()
    # what earlier tests keep (512 B in the whole tests/gpu run, from test_estimate_gpu on) is live
    # before the recording: a block the replay takes from the dump, as a recording started
    # mid-run has them; a small one made here makes sure that path is taken in every run. Large
    # blocks of earlier work, freed during the recording, would leave sizes open: not wanted
    before_small = torch.empty(100, dtype=torch.uint8, device="cuda")
    before = torch.cuda.memory_allocated()
    assert before < (1 << 20), f"{before} B of earlier tests live: large blocks would blur the replay"
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(max_entries=500_000, stacks=stacks)
    try:
        held = _workload()
        f = tmp_path / "s.pickle"
        torch.cuda.memory._dump_snapshot(str(f))
        now, peak = torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    del held, before_small
    gc.collect()
    tr = open_snapshot(f).trace()
    unsplit = sum(1 for j in range(tr.n_allocs)
                  if tr.el_block[j] > max(512, (tr.el_size[j] + 511) // 512 * 512))
    print(f"torch: now {now} peak {peak}; gpumon: blocks end {tr.allocated_blocks[-1]} "
          f"peak {tr.peak_blocks} (requested peak {tr.peak}); unsplit blocks {unsplit}, "
          f"rule misses {tr.block_rule_misses}; live before the recording {before} B, counted "
          f"from the dump {tr.blocks_base} B")
    assert tr.blocks_exact and tr.block_rule_misses == 0
    assert unsplit >= 1, "the workload left no unsplit remainder to check"
    assert tr.blocks_base == before
    assert tr.allocated_blocks[-1] == now
    assert tr.peak_blocks == peak
    s = report.summary(open_snapshot(f))
    assert s["peak_blocks"]["bytes"] == peak
