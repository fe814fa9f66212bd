"""A torch.compile'd transformer under `gpumon run` on a real GPU: the same graphs (count, no
break, no recompile) and the same first loss as the plain run, its median step time within 1%
of the plain run's (repetitions interleaved; benchmarks/compat_gpu.py), and gpumon still sees
its forward/backward/optimizer phases (torch.compile(model) calls its wrapper eagerly).

Run on the GPU machine:  python -m pytest tests/gpu/test_compat_gpu.py -q -s   (~1-2 min);
it writes benchmarks/compat_gpu.md (or $COMPAT_GPU_OUT).
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))


def test_compiled_transformer_same_graphs_and_speed_under_gpumon_run(tmp_path):
    import compat_gpu
    out = os.environ.get("COMPAT_GPU_OUT", str(ROOT / "benchmarks" / "compat_gpu.md"))
    raw = tmp_path / "raw.json"
    assert compat_gpu.main(["--device", "cuda", "--out", out, "--json", str(raw)]) == 0
    r = json.loads(raw.read_text())
    plain, mon = r["final"]["plain"], r["final"]["gpumon"]
    print(json.dumps({"ratios": r["ratios"], "median": r["median_ratio"],
                      "graphs": [plain["graphs"], mon["graphs"]],
                      "breaks": [plain["breaks"], mon["breaks"]]}))
    assert mon["gpumon"] and not plain["gpumon"]
    assert plain["graphs"] >= 1 and mon["graphs"] == plain["graphs"]
    assert plain["breaks"] == 0 and mon["breaks"] == 0
    assert mon["recompiles"] == plain["recompiles"]
    assert mon["losses"][0] == plain["losses"][0]  # later ones: atomics in embedding backward
    ph = mon["phases"]
    assert ph["roots"] and ph["recent"], ph
    assert all(f >= 1 and b >= 1 and {"forward", "backward", "optimizer"} <= set(p)
               for f, b, p in ph["recent"]), ph
    assert abs(r["median_ratio"]) <= 0.01, r["ratios"]
