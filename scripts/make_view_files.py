"""Real memory snapshots with C++ stacks (stacks='all') of 2-10 MB, for `gpumon view`'s speed
against ptmem (benchmarks/view_vs_ptmem.py takes their paths). Run on a GPU machine:

    python scripts/make_view_files.py --out DIR          # writes DIR/real-{small,mid,large}.pickle

Each file is a transformer-encoder training loop (AdamW) recorded with torch's own
`_record_memory_history(stacks='all')` until its ring of max_entries events is full (the
allocator's counters say how many events have happened), then dumped with `_dump_snapshot`,
exactly as a user would. Prints each file's size, events and dump time.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

# name, trace events (the ring's size), model layers
FILES = (("small", 9_000, 4), ("mid", 22_000, 6), ("large", 44_000, 8))


def events_so_far(torch) -> int:
    s = torch.cuda.memory_stats()
    # an alloc is one trace entry, a free two (free_requested, free_completed)
    return s.get("allocation.all.allocated", 0) + 2 * s.get("allocation.all.freed", 0)


def make(torch, path: str, events: int, layers: int) -> None:
    nn = torch.nn
    torch.manual_seed(0)
    model = nn.TransformerEncoder(nn.TransformerEncoderLayer(512, 8, 2048, batch_first=True),
                                  layers).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(16, 128, 512, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=events, stacks="all")
    try:
        start = events_so_far(torch)
        steps = 0
        while events_so_far(torch) - start < events * 1.05 or steps < 3:
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            steps += 1
        torch.cuda.synchronize()
        t0 = time.monotonic()
        torch.cuda.memory._dump_snapshot(path)
        dt = time.monotonic() - t0
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    del model, opt, x
    torch.cuda.empty_cache()
    print(f"{path}: {os.path.getsize(path) / 1e6:.1f} MB, ring {events:,} events, {steps} steps, "
          f"{layers} layers, dump {dt:.1f} s", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="folder to write the files into")
    ap.add_argument("--only", action="append", help="small, mid or large (repeatable)")
    a = ap.parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        print("make_view_files: needs CUDA (torch records allocation history on CUDA only)",
              file=sys.stderr)
        return 1
    os.makedirs(a.out, exist_ok=True)
    for name, events, layers in FILES:
        if a.only and name not in a.only:
            continue
        make(torch, os.path.join(a.out, f"real-{name}.pickle"), events, layers)
    return 0


if __name__ == "__main__":
    sys.exit(main())
