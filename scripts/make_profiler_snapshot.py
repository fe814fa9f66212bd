"""Write tests/view/data/profiler_categories.pickle: a snapshot as torch's memory_viz makes it
from the profiler's memory timeline (torch.cuda._memory_viz._profile_to_snapshot, what
`python -m torch.cuda._memory_viz profile_plot` draws), whose alloc events carry the
profiler's categories (parameter, optimizer_state, gradient, activation, ...). Three AdamW
steps of a small MLP on the CPU (no GPU needed: the CPU's allocations become device 0).

    python scripts/make_profiler_snapshot.py [OUT]
"""
import os
import pickle
import sys

import torch
from torch.cuda._memory_viz import _profile_to_snapshot


def main(out: str) -> None:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    opt = torch.optim.AdamW(m.parameters())
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                profile_memory=True, record_shapes=True,
                                with_stack=True) as prof:
        for _ in range(3):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(m(x), y).backward()
            opt.step()
    snap = _profile_to_snapshot(prof)
    with open(out, "wb") as f:
        pickle.dump(snap, f, protocol=4)
    print(f"wrote {out}: {sum(len(t) for t in snap['device_traces'])} events, torch "
          f"{torch.__version__}")


if __name__ == "__main__":
    here = os.path.dirname(os.path.abspath(__file__))
    main(sys.argv[1] if len(sys.argv) > 1 else
         os.path.join(here, "..", "tests", "view", "data", "profiler_categories.pickle"))
