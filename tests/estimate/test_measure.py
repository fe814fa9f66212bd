"""--measure on the meta device against autograd's saved bytes read directly on real CPU tensors,
and the analytical formula against --measure."""
import json
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from gpumon.estimate import Setup, estimate
from gpumon.estimate.activations import transformer_activations
from gpumon.estimate.arch import arch_from_config
from gpumon.estimate.measure import MeasureError, measure_activations

sys.path.insert(0, str(Path(__file__).parent))
from tiny_models import TinyLlama, mlp_model, saved_bytes_direct  # noqa: E402

CFG = Path(__file__).resolve().parents[1] / "fixtures" / "configs"


def cfg(name):
    return json.loads((CFG / f"{name}.json").read_text())


def test_mlp_meta_measure_equals_direct_cpu_count():
    torch.manual_seed(0)
    B, L = 4, 16

    def factory():
        m = mlp_model()
        m.example_input = lambda b, s: torch.randn(b, s, 64)
        return m

    r = measure_activations(B, L, factory=factory)
    direct = saved_bytes_direct(mlp_model(), torch.randn(B, L, 64))
    assert r["saved_bytes"] == direct
    assert r["n_params"] == sum(p.numel() for p in mlp_model().parameters())
    assert r["device"] == "fake"
    assert measure_activations(B, L, factory=factory, device="meta")["saved_bytes"] == direct


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("name", ["qwen-small", "llama-tiny"])
def test_tiny_transformer_eager_meta_equals_direct_cpu(name, dtype):
    c = cfg(name)
    c.update(num_hidden_layers=2)
    B, L = 2, 32
    tdt = torch.float32 if dtype == "fp32" else torch.bfloat16
    r = measure_activations(B, L, dtype, factory=lambda: TinyLlama(c, "eager"), attn="eager")
    torch.manual_seed(0)
    m = TinyLlama(c, "eager").to(tdt)
    direct = saved_bytes_direct(m, torch.randint(0, 100, (B, L)))
    assert r["saved_bytes"] == direct
    assert r["tied"] == bool(c.get("tie_word_embeddings"))


def test_flash_emulation_close_to_cpu_flash_kernel():
    # CPU's sdpa is a flash kernel too: it saves q, k, v, out and logsumexp, as the emulation does
    c = cfg("llama-tiny")
    c.update(num_hidden_layers=2, num_key_value_heads=8)
    B, L = 2, 64
    r = measure_activations(B, L, "bf16", factory=lambda: TinyLlama(c, "sdpa"))
    assert "flash" in r["attention"]
    m = TinyLlama(c, "sdpa").to(torch.bfloat16)
    direct = saved_bytes_direct(m, torch.randint(0, 100, (B, L)))
    assert abs(r["saved_bytes"] - direct) / direct < 0.02


@pytest.mark.parametrize("precision,dtype,attn", [("fp32", "fp32", "sdpa"), ("half", "bf16", "sdpa"),
                                                   ("fp32", "fp32", "eager"), ("half", "bf16", "eager")])
@pytest.mark.parametrize("name", ["qwen-small", "llama-tiny"])
def test_analytical_formula_matches_measure(name, precision, dtype, attn):
    c = cfg(name)
    arch = arch_from_config(c)
    B, L = 2, 64
    r = measure_activations(B, L, dtype, factory=lambda: TinyLlama(c, attn), attn=attn)
    am = transformer_activations(arch, B, L, precision, attn, loss="mean")
    analytical = am.layers * am.per_layer + am.final + B * L * 8      # + the int64 input ids
    assert r["n_params"] == arch.param_count()
    assert abs(analytical - r["saved_bytes"]) / r["saved_bytes"] < 0.002


def test_analytical_amp_matches_cpu_autocast():
    # autocast: fp32 norms and residual, one 16-bit copy per Linear input and per weight
    c = cfg("qwen-small")
    c.update(num_hidden_layers=2)
    arch = arch_from_config(c)
    B, L = 2, 32
    m = TinyLlama(c, "eager")
    skip = {p.untyped_storage().data_ptr() for p in m.parameters()}
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in skip:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autocast("cpu", dtype=torch.bfloat16), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        m(torch.randint(0, 100, (B, L)))
    am = transformer_activations(arch, B, L, "amp", "eager", loss="mean")
    analytical = am.layers * am.per_layer + am.final + B * L * 8 + 2 * arch.vocab * arch.hidden
    assert abs(analytical - sum(seen.values())) / sum(seen.values()) < 0.002


def test_measured_estimate_end_to_end():
    c = cfg("qwen-small")
    arch = arch_from_config(c)
    meas = measure_activations(2, 64, factory=lambda: TinyLlama(c, "sdpa"))
    em = estimate(Setup(batch=2, seq=64, measured=meas, loss="mean"))
    ea = estimate(Setup(arch=arch, batch=2, seq=64, loss="mean"))
    assert em.activation_method == "measured"
    assert em.n_params == ea.n_params
    assert abs(em.peak_bytes - ea.peak_bytes) / ea.peak_bytes < 0.05


def test_meta_device_cannot_enter_autocast_but_fake_can():
    c = cfg("llama-tiny")
    with pytest.raises(MeasureError, match="could not run forward"):
        measure_activations(1, 8, factory=lambda: TinyLlama(c, "eager"), attn="eager", device="meta")
    assert measure_activations(1, 8, factory=lambda: TinyLlama(c, "eager"), attn="eager")["saved_bytes"] > 0


def test_measure_errors_are_one_line():
    with pytest.raises(MeasureError, match="pkg.module:factory"):
        measure_activations(1, 8, model="nocolon")
    with pytest.raises(MeasureError, match="cannot import"):
        measure_activations(1, 8, model="no_such_module_xyz:build")
    with pytest.raises(MeasureError, match="autocast"):
        measure_activations(1, 8, model="x:y", amp=True)

    def broken():
        raise RuntimeError("boom")
    with pytest.raises(MeasureError, match="boom"):
        measure_activations(1, 8, factory=broken)
