"""Make the committed snapshot fixtures (tests/fixtures/snapshots/) on a machine with a GPU.

    python scripts/make_snapshot_fixtures.py            # all three, each in a fresh process
    python scripts/make_snapshot_fixtures.py --only oom

Each fixture is recorded by gpumon's own recorder (gpumon/agent/snapshot.py, the torch
backend) exactly as a user's `gpumon snapshot` would, so the files are what torch writes (plain
pickle of torch.cuda.memory._snapshot(), loadable by pytorch.org/memory_viz) plus gpumon's
sidecar ``.pickle.json``:

- linear_adam: the HF blog's example, a few Linear layers trained with Adam for a few steps
- transformer: a small transformer encoder trained with AdamW for a few steps
- oom: a small model trains, then asks for 10 TiB; the OOM flight recorder dumps at the OOM
- transformer_all: the transformer recorded with stacks='all' (C++ frames: what the view's
  Python-first stacks and frame filter are checked on; fewer entries, to stay under 2 MB)

Kept small (well under 2 MB each: few steps, python stacks, bounded max_entries). Machine-
specific paths in frames are left as they are (they are what a user's snapshot holds).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "snapshots"
MAX_BYTES = 2_000_000
NAMES = ("linear_adam", "transformer", "oom", "transformer_all")


def _recorder(work: str):
    sys.path.insert(0, str(ROOT))
    from gpumon.agent import snapshot as snap
    events: list = []
    rec = snap.Recorder(None, backend=snap.TorchBackend(), pid=os.getpid(), cwd=work,
                        broadcast=lambda kind, **p: events.append((kind, p)))
    return snap, rec, events


def linear_adam(torch, rec, max_entries):
    # The blog's first example: Linear layers + Adam, a few steps.
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(3)]).cuda()
    opt = torch.optim.Adam(model.parameters())
    rec.start({"max_entries": max_entries, "who": "make_snapshot_fixtures"}, "script")
    for _ in range(3):
        x = torch.randn(128, 1024, device="cuda")
        model(x).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    return rec.stop({}, "script")


def transformer_all(torch, rec, max_entries):
    return transformer(torch, rec, max_entries, stacks="all")


def transformer(torch, rec, max_entries, stacks="python"):
    torch.manual_seed(0)
    vocab, d, seq, batch = 1000, 256, 64, 8
    layer = torch.nn.TransformerEncoderLayer(d, nhead=4, dim_feedforward=4 * d,
                                             batch_first=True)
    model = torch.nn.ModuleDict({
        "emb": torch.nn.Embedding(vocab, d),
        "enc": torch.nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False),
        "head": torch.nn.Linear(d, vocab)}).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    rec.start({"max_entries": max_entries, "who": "make_snapshot_fixtures", "stacks": stacks},
              "script")
    for _ in range(3):
        tokens = torch.randint(0, vocab, (batch, seq), device="cuda")
        h = model["enc"](model["emb"](tokens))
        logits = model["head"](h)
        loss = torch.nn.functional.cross_entropy(logits.view(-1, vocab), tokens.view(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    return rec.stop({}, "script")


def oom(torch, rec, max_entries):
    rec.oom_max_entries = max_entries
    rec.enable_oom()  # CUDA is initialised by now: recording starts at once
    model = torch.nn.Sequential(torch.nn.Linear(2048, 2048), torch.nn.GELU(),
                                torch.nn.Linear(2048, 2048)).cuda()
    opt = torch.optim.AdamW(model.parameters())
    for _ in range(2):
        model(torch.randn(64, 2048, device="cuda")).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    acts = [torch.empty(32 << 20, dtype=torch.uint8, device="cuda") for _ in range(3)]
    try:
        torch.empty(10 << 40, dtype=torch.uint8, device="cuda")
    except torch.OutOfMemoryError:
        pass
    del acts
    if rec.last is None or rec.last.get("trigger") != "oom":
        raise SystemExit("the OOM observer did not write a snapshot")
    return rec.last


def sanitise(pickle_path: Path, root: Path = ROOT) -> int:
    """Frames of this checkout's files named relative to it ("scripts/make_snapshot_fixtures.py",
    not "/work/main/scripts/..."): a committed fixture must not carry a maintainer's paths.
    Rewrites the pickle (and its sidecar's size); returns the number of frames renamed."""
    import pickle
    data = pickle.loads(pickle_path.read_bytes())
    prefix = str(root).rstrip("/") + "/"
    renamed = 0

    def walk(o) -> None:
        nonlocal renamed
        if isinstance(o, dict):
            f = o.get("filename")
            if isinstance(f, str) and f.startswith(prefix):
                o["filename"] = f[len(prefix):]
                renamed += 1
            for v in o.values():
                walk(v)
        elif isinstance(o, (list, tuple)):
            for v in o:
                walk(v)
    walk(data)
    pickle_path.write_bytes(pickle.dumps(data))
    side = Path(str(pickle_path) + ".json")
    if side.exists():
        meta = json.loads(side.read_text())
        meta["size"] = pickle_path.stat().st_size
        side.write_text(json.dumps(meta, indent=1) + "\n")
    return renamed


def one(name: str, max_entries: int) -> None:
    import torch
    if not torch.cuda.is_available():
        raise SystemExit("needs CUDA")
    torch.cuda.init()
    work = tempfile.mkdtemp(prefix="gpumon-fixture-")
    snap, rec, _ = _recorder(work)
    facts = globals()[name](torch, rec, max_entries)
    src = Path(facts["path"])
    OUT.mkdir(parents=True, exist_ok=True)
    dst = OUT / f"{name}.pickle"
    shutil.copyfile(src, dst)
    meta = json.loads(Path(str(src) + ".json").read_text())
    # Keep the sidecar, minus what says where and who made it.
    meta.update({"argv": ["scripts/make_snapshot_fixtures.py", "--only", name],
                 "cwd": None, "hostname": None})
    (OUT / f"{name}.pickle.json").write_text(json.dumps(meta, indent=1) + "\n")
    sanitise(dst)
    shutil.rmtree(work, ignore_errors=True)
    print(json.dumps({"name": name, "size": dst.stat().st_size, "entries": facts["entries"],
                      "torch": torch.__version__, "device": torch.cuda.get_device_name()}))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=NAMES)
    ap.add_argument("--max-entries", type=int, default=4000)
    ap.add_argument("--_child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a._child:
        one(a.only, a.max_entries)
        return 0
    rc = 0
    for name in ([a.only] if a.only else NAMES):
        max_entries = a.max_entries
        while True:  # a fresh process each: the OOM observer can't be detached
            r = subprocess.run([sys.executable, __file__, "--_child", "--only", name,
                                "--max-entries", str(max_entries)],
                               capture_output=True, text=True)
            if r.returncode:
                print(f"{name}: failed\n{r.stderr}", file=sys.stderr)
                rc = 1
                break
            size = (OUT / f"{name}.pickle").stat().st_size
            if size <= MAX_BYTES or max_entries <= 250:
                print(r.stdout.strip())
                break
            max_entries //= 2  # too big to commit: keep fewer (the newest) entries
    return rc


if __name__ == "__main__":
    sys.exit(main())
