"""Real memory snapshots of the everyday kind, made on a GPU, for the viewer's speed benchmark
(benchmarks/view_vs_ptmem.py) and the view's Python-first tests: torch's own recorder, started
before the first CUDA call, C++ and Python stacks (stacks='all'), a few training steps of a
Hugging Face model built from a config (random weights, no download).

    python scripts/make_real_snapshots.py OUTDIR            # on the GPU machine

Writes OUTDIR/<name>.pickle (plain torch._snapshot() pickles, what memory_viz reads).
"""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "tests" / "fixtures" / "configs"

# name: (config, batch, seq, steps, stacks, dtype)
CASES = {
    "qwen1.5b-b2-all": ("qwen2.5-1.5b.json", 2, 256, 3, "all", "float32"),
    "qwen0.5b-b8-all": ("qwen2.5-0.5b.json", 8, 512, 4, "all", "bfloat16"),
    "qwen1.5b-b2-python": ("qwen2.5-1.5b.json", 2, 256, 3, "python", "float32"),
}

CHILD = textwrap.dedent("""
    import json, sys, time, torch, transformers
    cfg_path, batch, seq, steps, stacks, dtype, out = sys.argv[1:8]
    torch.cuda.memory._record_memory_history(max_entries=200000, stacks=stacks)
    cfg = json.load(open(cfg_path)); mt = cfg.pop("model_type"); cfg["use_cache"] = False
    config = transformers.AutoConfig.for_model(mt, **cfg)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(
            config, dtype=getattr(torch, dtype), attn_implementation="sdpa")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    ids = torch.randint(0, config.vocab_size, (int(batch), int(seq)), device="cuda")
    for _ in range(int(steps)):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    t0 = time.time()
    torch.cuda.memory._dump_snapshot(out)
    print(json.dumps({"out": out, "dump_s": round(time.time() - t0, 2),
                      "max_allocated": torch.cuda.max_memory_allocated()}))
""")


def main() -> int:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "real-snapshots")
    out.mkdir(parents=True, exist_ok=True)
    rc = 0
    for name, (cfg, batch, seq, steps, stacks, dtype) in CASES.items():
        if not (CONFIGS / cfg).exists():
            print(f"{name}: no config {cfg}, skipped")
            continue
        path = out / f"{name}.pickle"
        r = subprocess.run([sys.executable, "-c", CHILD, str(CONFIGS / cfg), str(batch), str(seq),
                            str(steps), stacks, dtype, str(path)], capture_output=True, text=True)
        if r.returncode:
            rc = 1
            print(f"{name}: failed: {r.stderr.strip().splitlines()[-1:]}")
            continue
        info = json.loads(r.stdout.strip().splitlines()[-1])
        print(f"{name}: {path.stat().st_size / 1e6:.1f} MB, dump {info['dump_s']} s, "
              f"max_allocated {info['max_allocated']}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
