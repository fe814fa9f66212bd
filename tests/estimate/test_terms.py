"""Every term of the estimate against hand-computed bytes, and the FACTS.md/blog numbers."""
from dataclasses import replace
from pathlib import Path

import pytest

from gpumon.estimate import Setup, estimate, load_config, parse_bytes, parse_count, fmt_bytes
from gpumon.estimate.activations import blog_heuristic_bytes, resolve_attention, transformer_activations
from gpumon.estimate.arch import ConfigError, arch_from_config
from gpumon.estimate.optim import optimizer_cost
from gpumon.estimate.core import DEFAULT_WORKSPACE_BYTES as WS  # noqa: E402

CFG = Path(__file__).resolve().parents[1] / "fixtures" / "configs"
GiB = 2**30
N_QWEN = 1_543_714_304


@pytest.fixture(scope="module")
def qwen():
    return load_config(CFG / "qwen2.5-1.5b.json")[0]


def test_qwen_param_count_counts_tied_embedding_once(qwen):
    assert qwen.param_count() == N_QWEN
    untied = replace(qwen, tie_embeddings=False)
    assert untied.param_count() == N_QWEN + 151936 * 1536


def test_gpt2_small_param_count():
    a = load_config(CFG / "gpt2-small.json")[0]
    assert a.family == "gpt2" and a.param_count() == 124_439_808


def test_llama_tiny_param_count_by_hand():
    a = load_config(CFG / "llama-tiny.json")[0]
    h, i, V, L = 256, 688, 8192, 4
    layer = 4 * h * h + 3 * h * i + 2 * h      # q k v o (MHA, kv 4 of 8 heads -> k,v are h/2)
    layer = h * h + 2 * h * (h // 2) + h * h + 3 * h * i + 2 * h
    assert a.param_count() == 2 * V * h + L * layer + h


def test_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="no such config"):
        load_config(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config(bad)
    with pytest.raises(ConfigError, match="lacks"):
        arch_from_config({"model_type": "llama", "hidden_size": 8})


def test_units():
    assert parse_bytes("80GiB") == 80 * GiB
    assert parse_bytes("80GB") == 80 * 10**9
    assert parse_bytes("512 MiB") == 512 * 2**20
    assert parse_count("1.5e9") == 1_500_000_000 and parse_count("350M") == 350_000_000
    assert parse_count("7B") == 7 * 10**9
    with pytest.raises(ValueError):
        parse_bytes("lots")
    assert fmt_bytes(43.8 * GiB) == "43.8 GiB"


# --- optimizer state and temporaries -----------------------------------------------------------
@pytest.mark.parametrize("name,impl,state,temp", [
    ("adamw", "foreach", 2 * 1000 * 4, 1000 * 4),
    ("adamw", "fused", 2 * 1000 * 4, 0),
    ("adamw", "for-loop", 2 * 1000 * 4, 2 * 100 * 4),
    ("adam", "for-loop", 2 * 1000 * 4, 3 * 100 * 4),      # L2 decay: grad.add(param) lives on
    ("adam", "foreach", 2 * 1000 * 4, 1000 * 4),          # the foreach grad copy is deleted before sqrt
    ("sgd", "foreach", 0, 1000 * 4),                      # weight decay copy of the grads
    ("sgd-momentum", "foreach", 1000 * 4, 1000 * 4),
    ("lion", "for-loop", 1000 * 4, 2 * 100 * 4),          # clone + out-of-place add of one param
    ("adamw8bit", "foreach", 2 * 4 * 1000, 0),            # under 4096 elements: bitsandbytes keeps fp32 state
])
def test_optimizer_costs(name, impl, state, temp):
    c = optimizer_cost(name, impl, 1000, 100, 4, weight_decay=True)
    assert (c.state_bytes, c.temp_bytes) == (state, temp)


def test_weight_decay_defaults_follow_torch(qwen):
    s = Setup(arch=qwen, batch=1, seq=64, optimizer="sgd-momentum")
    assert estimate(s).term("opt_temp").bytes == 0                       # SGD's default weight_decay=0
    assert estimate(replace(s, weight_decay=True)).term("opt_temp").bytes == 4 * N_QWEN
    assert estimate(replace(s, optimizer="adam", impl="for-loop")).term("opt_temp").bytes == 2 * 4 * 151936 * 1536


def test_sgd_without_weight_decay_has_no_temporaries():
    assert optimizer_cost("sgd", "foreach", 1000, 100, 4, weight_decay=False).temp_bytes == 0
    assert optimizer_cost("sgd", "foreach", 1000, 100, 4, weight_decay=False).state_bytes == 0


def test_adafactor_state_is_factored(qwen):
    e = estimate(Setup(arch=qwen, batch=1, seq=128, optimizer="adafactor", impl="foreach"))
    # rows + cols per matrix: far below Adam's 2 x N
    assert e.term("opt_state").bytes < 0.01 * N_QWEN * 4
    assert e.term("opt_temp").bytes == N_QWEN * 4           # foreach var_estimates


def test_unknown_optimizer():
    with pytest.raises(ValueError, match="unknown optimizer"):
        optimizer_cost("rmsprop2", "foreach", 1, 1, 4)


# --- the big terms for the blog's model --------------------------------------------------------
def test_blog_model_terms(qwen):
    e = estimate(Setup(arch=qwen, batch=2, seq=256, loss="mean"))
    assert e.term("params").bytes == 4 * N_QWEN
    assert e.term("grads").bytes == 4 * N_QWEN
    assert e.term("opt_state").bytes == 8 * N_QWEN
    assert e.term("opt_temp").bytes == 4 * N_QWEN
    # the blog's optimizer branch: 5 x N x 4 (+ the cuBLAS workspaces)
    assert e.peak_phase == "optimizer step"
    assert e.peak_bytes == 20 * N_QWEN + WS
    assert abs(e.peak_bytes / GiB - 28.8) < 0.1               # FACTS.md: 28.8 GiB measured


def test_blog_batch16_peak_in_forward_backward(qwen):
    e = estimate(Setup(arch=qwen, batch=16, seq=256, loss="mean"))
    assert e.peak_phase == "forward/backward"
    assert abs(e.peak_bytes / GiB - 43.8) / 43.8 < 0.02       # FACTS.md: 43.8 GiB measured
    assert e.activation_method == "analytical"


def test_fused_and_for_loop_move_the_batch2_peak(qwen):
    s = Setup(arch=qwen, batch=2, seq=256, loss="mean")
    fe = estimate(s).peak_bytes
    fl = estimate(replace(s, impl="for-loop")).peak_bytes
    fu = estimate(replace(s, impl="fused")).peak_bytes
    Vh = 151936 * 1536
    assert fl == 16 * N_QWEN + 2 * Vh * 4 + WS    # step temporaries: 2 x the embedding, the largest tensor
    assert abs(fl / GiB - 24.8) < 0.1
    assert fl < fe
    # fused has no step temporaries, so its peak moves to the end of backward, where the tied
    # embedding's gradient is summed out of place with lm_head's (old + new + sum: 2 x V x h on top
    # of the gradients; test_cpu_peak measures it). That is the same 2 x V x h as for-loop's temporaries.
    efu = estimate(replace(s, impl="fused"))
    assert efu.peak_phase == "forward/backward" and efu.peak_moment.startswith("end of backward")
    assert fu == 16 * N_QWEN + 2 * Vh * 4 + WS == fl
    assert efu.phases["optimizer step"] == 16 * N_QWEN + WS
    untied = replace(s, arch=replace(qwen, tie_embeddings=False), impl="fused")
    eu = estimate(untied)   # untied: the embedding's gradient becomes .grad itself, no extra
    assert eu.phases["forward/backward"] == eu.phases["optimizer step"] == 16 * eu.n_params + WS


def test_blog_heuristic_numbers():
    # A = 4.6894e-4 x N + 1.8494e6 activations per token; bytes = A x B x L x P
    a = 4.6894e-4 * N_QWEN + 1.8494e6
    assert blog_heuristic_bytes(N_QWEN, 16, 256, 4) == int(a * 16 * 256 * 4)
    # the blog's 5,065,216 "activations per token" is bytes in fp32: 1,266,304 values x 4
    assert 1_266_304 * 4 == 5_065_216
    e = estimate(Setup(n_params=N_QWEN, batch=16, seq=256))
    assert e.activation_method == "heuristic"
    assert e.term("activations").bytes == int(a * 16 * 256 * 4)
    # total = model + optimizer + max(grads + intermediates, activations)
    assert e.blog["total_bytes"] == 4 * N_QWEN + 8 * N_QWEN + max(8 * N_QWEN, int(a * 16 * 256 * 4))


# --- activations by hand -----------------------------------------------------------------------
def test_fp32_math_attention_layer_by_hand(qwen):
    B, L = 16, 256
    T, h, i, H = B * L, 1536, 8960, 12
    am = transformer_activations(qwen, B, L, "fp32", "sdpa", loss="mean")
    assert am.attention == "math"                  # fp32 + grouped-query attention: no efficient kernel
    # 3 x norm(x, x*rsqrt, out) -> 6 T h; q, k, v scaled/repeated and o_proj's input: 4 T h;
    # gate, silu, up, product: 4 T i; softmax probs: B H L^2
    assert am.per_layer == 4 * (10 * T * h + 4 * T * i + B * H * L * L)
    assert am.head_fwd_extra == T * 151936 * 4      # fp32 logits
    assert am.final == 4 * 3 * T * h + 2 * T * 128 * 4


def test_flash_attention_has_no_L2_term(qwen):
    B, L = 4, 1024
    T = B * L
    am = transformer_activations(qwen, B, L, "half", "sdpa", loss="ce")
    assert am.attention == "flash"
    # norms in half: fp32 upcast + half x*rsqrt + half output = 8 bytes x T h, twice
    # attention: q_embed, k_embed, v, out (16-bit); MLP 4 x T i (16-bit); + logsumexp
    per_tok = 2 * (4 + 2 + 2) * 1536 + 2 * (1536 + 2 * 256 + 1536) + 4 * 2 * 8960
    assert am.per_layer == T * per_tok + B * 12 * 1024 * 4


def test_amp_adds_weight_copies_and_casts(qwen):
    am = transformer_activations(qwen, 1, 128, "amp", "sdpa")
    lin = sum(a * b for _, a, b, _ in qwen.linears())
    assert am.per_layer_weight_copies == 2 * lin
    assert am.head_saved == 4 * 128 * 151936 + 2 * 151936 * 1536   # log_softmax + 16-bit lm_head copy


def test_checkpointing_keeps_only_layer_inputs(qwen):
    am = transformer_activations(qwen, 8, 512, "fp32", checkpointing=True)
    assert am.per_layer_stored == 8 * 512 * 1536 * 4
    s = Setup(arch=qwen, batch=8, seq=512)
    assert estimate(replace(s, checkpointing=True)).peak_bytes < estimate(s).peak_bytes


def test_resolve_attention_rules(qwen):
    mha = replace(qwen, kv_heads=12)
    assert resolve_attention("sdpa", qwen, 2) == "flash"
    assert resolve_attention("sdpa", qwen, 4) == "math"
    assert resolve_attention("sdpa", mha, 4) == "efficient"
    assert resolve_attention("eager", qwen, 2) == "eager"


def test_eager_attention_costs_more_than_flash(qwen):
    s = Setup(arch=qwen, batch=4, seq=2048, dtype="bf16")
    assert estimate(replace(s, attn="eager")).peak_bytes > estimate(s).peak_bytes


# --- precisions, frozen parameters, LoRA, sharding ---------------------------------------------
def test_bf16_weights_halve_model_states(qwen):
    e = estimate(Setup(arch=qwen, batch=1, seq=64, dtype="bf16"))
    assert e.term("params").bytes == 2 * N_QWEN and e.term("opt_state").bytes == 4 * N_QWEN
    e = estimate(Setup(arch=qwen, batch=1, seq=64, dtype="bf16", state_dtype="fp32"))
    assert e.term("opt_state").bytes == 8 * N_QWEN


def test_amp_keeps_fp32_master_weights(qwen):
    e = estimate(Setup(arch=qwen, batch=1, seq=64, dtype="bf16", amp=True))
    assert e.term("params").bytes == 4 * N_QWEN and e.term("grads").bytes == 4 * N_QWEN
    assert e.term("weight_copies").bytes == 2 * qwen.layers * sum(a * b for _, a, b, _ in qwen.linears())


def test_lora_trains_only_adapters(qwen):
    e = estimate(Setup(arch=qwen, batch=1, seq=64, dtype="bf16", lora_rank=8))
    n_lora = 28 * 8 * ((1536 + 1536) + (1536 + 256))        # q_proj and v_proj
    assert e.n_trainable == n_lora and e.n_params == N_QWEN + n_lora
    assert e.term("grads").bytes == 2 * n_lora
    assert e.term("opt_state").bytes == 2 * 2 * n_lora


def test_frozen_embeddings_and_trainable_count(qwen):
    e = estimate(Setup(arch=qwen, batch=1, seq=64, freeze_embeddings=True))
    assert e.n_trainable == N_QWEN - 151936 * 1536
    e = estimate(Setup(n_params=10**9, trainable_params=10**8, batch=1, seq=64))
    assert e.term("grads").bytes == 4 * 10**8 and e.term("opt_state").bytes == 8 * 10**8


def test_zero_sharding_divides_model_states(qwen):
    base = Setup(arch=qwen, batch=1, seq=64)
    z1 = estimate(replace(base, shards=8, zero_stage=1))
    assert z1.term("opt_state").bytes == 8 * N_QWEN // 8 and z1.term("grads").bytes == 4 * N_QWEN
    z3 = estimate(replace(base, shards=8, zero_stage=3))
    assert z3.term("params").bytes == 4 * N_QWEN // 8 and z3.term("grads").bytes == 4 * N_QWEN // 8
    assert any("ZeRO-3" in a for a in z3.assumptions)


def test_grads_in_forward_raise_the_forward_peak(qwen):
    s = Setup(arch=qwen, batch=16, seq=256, loss="mean")
    assert estimate(replace(s, grads_in_forward=True)).phases["forward/backward"] > estimate(s).phases["forward/backward"]


def test_shares_at_peak_sum_to_the_peak(qwen):
    for b in (2, 16):
        e = estimate(Setup(arch=qwen, batch=b, seq=256, loss="mean"))
        assert sum(t.at_peak for t in e.terms) == e.peak_bytes


def test_nvml_range_is_above_the_allocated_peak(qwen):
    e = estimate(Setup(arch=qwen, batch=2, seq=256))
    lo, hi = e.nvml_range
    assert e.peak_bytes + 0.5 * GiB <= lo < hi


def test_bad_inputs():
    from gpumon.estimate import EstimateError
    with pytest.raises(EstimateError):
        estimate(Setup(batch=0, n_params=10))
    with pytest.raises(EstimateError):
        estimate(Setup())
    with pytest.raises(EstimateError, match="analytical"):
        estimate(Setup(n_params=10, activations="analytical"))


def test_two_cublas_workspaces_by_default():
    """One per thread that runs matmuls in a step (the forward's, autograd's backward thread), 32 MiB
    each on sm90: every H200 row of benchmarks/estimate_accuracy.md was 20-40 MiB under with one."""
    from gpumon.estimate.core import CUBLAS_HANDLES_PER_STEP, CUBLAS_WORKSPACE_SM90
    assert WS == CUBLAS_HANDLES_PER_STEP * CUBLAS_WORKSPACE_SM90 == 64 * 2**20
    e = estimate(Setup(n_params=10**8, batch=1, seq=16))
    assert e.term("workspace").bytes == e.term("workspace").at_peak == WS
    assert estimate(Setup(n_params=10**8, batch=1, seq=16, workspace_bytes=0)).peak_bytes == e.peak_bytes - WS
