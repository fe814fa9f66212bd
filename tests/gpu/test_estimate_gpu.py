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
        # as the GPU runs it: no mask (HF skips it), flash in bf16; fp32 grouped-query: math
        assert m["attention"] == ("math" if dtype == "fp32" else "flash")
        assert abs(em.peak_bytes - ea.peak_bytes) / ea.peak_bytes < 0.05


LIVE_PROG = """
import sys, time
sys.path.insert(0, {bench!r})
import gpumon
gpumon.start(rate_hz=20)          # before torch, as under `gpumon run`
import torch, transformers
import estimate_accuracy as bench
row = bench.Row("live", bench.Q05, {batch}, {seq})
model, config = bench.build(torch, transformers, row)
opt = bench.make_optimizer(torch, row, model.parameters())
ids = torch.randint(0, config.vocab_size, (row.batch, row.seq), device="cuda")
print("ready", flush=True)
t_end = time.time() + 300
while time.time() < t_end:
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
"""


def test_check_against_a_live_cuda_run(tmp_path):
    """`gpumon estimate --config ... --check PID` on a real training process with the torch source:
    the agent's exact role bytes and max_memory_allocated against the estimate."""
    import json
    import os
    import subprocess
    import time as _time
    from gpumon import client
    batch, seq = 4, 512
    env = dict(os.environ)
    env.pop("GPUMON", None)
    env.pop("GPUMON_SOURCE", None)
    p = subprocess.Popen([sys.executable, "-c", LIVE_PROG.format(bench=str(ROOT / "benchmarks"), batch=batch, seq=seq)],
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
    try:
        end = _time.monotonic() + 180
        while not client.discover(p.pid):
            assert p.poll() is None, p.communicate()[1].decode()[-3000:]
            assert _time.monotonic() < end, "no agent socket"
            _time.sleep(0.2)
        cfg = str(bench.CONFIGS / f"{bench.Q05}.json")
        argv = [sys.executable, "-m", "gpumon", "estimate", "--config", cfg, "--batch", str(batch),
                "--seq", str(seq), "--check", str(p.pid), "--timeout", "180"]
        r = subprocess.run(argv + ["--json"], capture_output=True, text=True, timeout=240)
        assert r.returncode == 0, r.stderr
        d = json.loads(r.stdout)
        text = subprocess.run(argv, capture_output=True, text=True, timeout=240).stdout
        print(text)
    finally:
        p.kill()
        p.wait()
    rows = {x["role"]: x for x in d["comparison"]["rows"]}
    assert d["device"] == 0
    assert abs(rows["parameters"]["error_pct"]) < 0.1          # the rotary buffer is the difference
    assert abs(rows["optimizer_state"]["error_pct"]) < 0.1
    g = rows["gradients"]        # none at the end of forward: then both are 0
    assert g["measured"] == g["estimate"] == 0 or abs(g["error_pct"]) < 0.1
    assert rows["peak"]["measured"] is not None
    assert abs(d["comparison"]["peak_error_pct"]) < 10
    assert d["comparison"]["measured_phase"] == d["comparison"]["estimate_phase"]
