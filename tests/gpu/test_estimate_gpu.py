"""The estimator against real training steps on the GPU (models from config, random weights).

Run on the GPU machine:  python -m pytest tests/gpu/test_estimate_gpu.py -q
The full table lives in benchmarks/estimate_accuracy.py (and .md); this test checks a few rows
against the 10% target and the FACTS.md numbers of the blog's loop.
"""
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import estimate_accuracy as bench  # noqa: E402

ROWS = {
    "blog-b2": bench.Row("blog-b2", bench.Q15, 2, 256, loss="mean"),                 # FACTS: 28.8 GiB
    "fp32": bench.Row("fp32", bench.Q05, 4, 512),
    "amp": bench.Row("amp", bench.Q05, 4, 1024, dtype="bf16", amp=True, impl="fused"),
    "bf16": bench.Row("bf16", bench.Q05, 4, 1024, dtype="bf16"),
    "ckpt": bench.Row("ckpt", bench.Q05, 8, 1024, dtype="bf16", amp=True, ckpt=True),
    "sgd-momentum": bench.Row("sgd-momentum", bench.Q05, 4, 512, optimizer="sgd-momentum"),
    "mha-efficient": bench.Row("mha-efficient", bench.MHA, 8, 512),
}


@pytest.mark.parametrize("key", list(ROWS))
def test_estimate_within_10_percent_of_max_memory_allocated(key):
    row = ROWS[key]
    est = bench.estimate_row(row, measure=False)
    meas = bench.measure_row(torch, transformers, row, steps=2)
    err = (est["estimate"] - meas["peak"]) / meas["peak"]
    print(f"{row.label()}: estimate {est['estimate'] / 2**30:.2f} GiB, measured {meas['peak'] / 2**30:.2f} GiB, "
          f"error {100 * err:+.1f}%")
    assert abs(err) < 0.10
    if key == "blog-b2":
        assert abs(meas["peak"] / 2**30 - 28.8) < 0.3          # FACTS.md
        assert est["phase"] == "optimizer step"


def test_measure_on_fake_tensors_matches_the_analytical_formula():
    """--measure builds the HF model on fake tensors and counts saved tensors; the analytical
    formula must agree with it (they are independent derivations)."""
    from gpumon.estimate import Setup, estimate, load_config
    from gpumon.estimate.measure import measure_activations
    cfg = bench.CONFIGS / "qwen2.5-0.5b.json"
    arch, _ = load_config(cfg)
    for dtype in ("fp32", "bf16"):
        m = measure_activations(4, 512, dtype, config=str(cfg))
        assert m["n_params"] == arch.param_count()
        em = estimate(Setup(batch=4, seq=512, dtype=dtype, measured=m))
        ea = estimate(Setup(arch=arch, batch=4, seq=512, dtype=dtype))
        print(dtype, m["saved_bytes"], m["attention"], em.peak_bytes, ea.peak_bytes)
        assert abs(em.peak_bytes - ea.peak_bytes) / ea.peak_bytes < 0.05
