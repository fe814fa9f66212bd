"""How right is `gpumon estimate`? Train real models built from config.json on the GPU and compare
the estimate with torch.cuda.max_memory_allocated() of steady-state steps.

    python benchmarks/estimate_accuracy.py                 # default rows, under 6 min on one H200
    python benchmarks/estimate_accuracy.py --rows quick    # 7 rows, ~2 min
    python benchmarks/estimate_accuracy.py --rows all      # every row
    python benchmarks/estimate_accuracy.py --only 1.5b     # rows whose name contains "1.5b"
    python benchmarks/estimate_accuracy.py --list          # print the rows and exit
    python benchmarks/estimate_accuracy.py --rows held     # issue 34's held-out architectures (<= 300 s, H100)
    python benchmarks/estimate_accuracy.py --rows held --device cpu --tiny   # the same code paths on CPU, shrunk

Needs CUDA and transformers (models are built with AutoModelForCausalLM.from_config: random
weights, nothing downloaded). Writes benchmarks/estimate_accuracy.md (--out) with one line per
configuration: the analytical estimate, the --measure estimate (fake tensors, counted through
saved-tensor hooks), the blog's formula, the measured peak and the errors; the allocator's rounding
(max_memory_allocated minus the peak of requested bytes); and the worst case.

Each row: build the model on the GPU, one step (the optimizer state appears), reset the peak
statistics, `--steps` more steps, read max_memory_allocated. The training step is the plain loop:
    loss = model(input_ids=ids, labels=ids).loss      # or .logits.mean() for the blog's loss
    loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
(with torch.autocast around the forward for autocast rows).
"""
from __future__ import annotations

import argparse
import gc
import json
import multiprocessing
import os
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
CONFIGS = ROOT / "tests" / "fixtures" / "configs"


@dataclass
class Row:
    name: str
    config: str
    batch: int
    seq: int
    dtype: str = "fp32"        # weights (and compute) dtype; with amp the autocast dtype
    amp: bool = False
    optimizer: str = "adamw"   # adamw | sgd | sgd-momentum | adafactor (torch.optim.Adafactor, torch >= 2.5)
    impl: str | None = "foreach"   # None: neither foreach= nor fused= passed (the optimizer's own default)
    ckpt: bool = False
    loss: str = "ce"
    attn: str | None = "sdpa"   # None: the model's own (config, else transformers' default); math/flash/efficient: sdpa forced to it
    sets: tuple = ("all",)

    def label(self) -> str:
        prec = f"{self.dtype} autocast" if self.amp else self.dtype
        bits = [self.config, f"b{self.batch} s{self.seq}", prec, f"{self.optimizer} {self.impl or 'default'}"]
        if self.ckpt:
            bits.append("checkpointing")
        if self.attn != "sdpa":
            bits.append(self.attn or "own attention")
        bits.append(f"{self.loss} loss")
        return ", ".join(bits)


Q15, Q05, MHA, GPT2, MSW = "qwen2.5-1.5b", "qwen2.5-0.5b", "llama-mha-300m", "gpt2-small", "mistral-sw-300m"
MIXT, Q2M, Q3M = "mixtral-tiny-moe", "qwen2-moe-tiny", "qwen3-moe-tiny"
D, Q = ("all", "default"), ("all", "default", "quick")
ROWS = [
    # the blog's loop (FACTS.md: 43.8 GiB at batch 16, 28.8 GiB at batch 2; fused/for-loop 24.8 GiB)
    Row("1.5b-b16-blog", Q15, 16, 256, loss="mean", sets=Q),
    Row("1.5b-b2-blog", Q15, 2, 256, loss="mean", sets=Q),
    Row("1.5b-b2-fused", Q15, 2, 256, impl="fused", loss="mean", sets=D),
    Row("1.5b-b2-forloop", Q15, 2, 256, impl="for-loop", loss="mean", sets=D),
    Row("1.5b-amp-b8", Q15, 8, 512, dtype="bf16", amp=True, impl="fused", sets=D),
    Row("1.5b-ckpt-b16", Q15, 16, 512, ckpt=True, sets=D),
    Row("1.5b-bf16-b8", Q15, 8, 1024, dtype="bf16", sets=("all",)),
    # Qwen2.5-0.5B shape: precisions, optimizers, checkpointing, attention
    Row("0.5b-fp32-b8", Q05, 8, 512, sets=Q),
    Row("0.5b-bf16-b8", Q05, 8, 1024, dtype="bf16", sets=Q),
    Row("0.5b-amp-b8", Q05, 8, 1024, dtype="bf16", amp=True, sets=Q),
    Row("0.5b-amp-fused-b16", Q05, 16, 1024, dtype="bf16", amp=True, impl="fused", sets=D),
    Row("0.5b-sgdm-b8", Q05, 8, 512, optimizer="sgd-momentum", sets=D),
    Row("0.5b-sgd-b4", Q05, 4, 512, optimizer="sgd", sets=D),
    Row("0.5b-forloop-b4", Q05, 4, 512, impl="for-loop", sets=D),
    # small batch, mean loss: the peak is in the optimizer step, where the optimizers differ
    Row("0.5b-adafactor-b1-mean", Q05, 1, 128, optimizer="adafactor", loss="mean", sets=Q),
    Row("0.5b-bf16-b1-mean", Q05, 1, 128, dtype="bf16", loss="mean", sets=D),
    Row("0.5b-amp-b1-mean", Q05, 1, 128, dtype="bf16", amp=True, loss="mean", sets=D),
    Row("mha-forloop-b1-mean", MHA, 1, 128, impl="for-loop", loss="mean", sets=D),
    Row("mha-adafactor-b1-mean", MHA, 1, 128, optimizer="adafactor", loss="mean", sets=D),
    Row("0.5b-adafactor-b8", Q05, 8, 512, optimizer="adafactor", sets=D),
    Row("0.5b-adafactor-forloop-b4", Q05, 4, 512, optimizer="adafactor", impl="for-loop", sets=("all",)),
    Row("0.5b-bf16-fused-b16", Q05, 16, 1024, dtype="bf16", impl="fused", sets=D),
    Row("0.5b-fp32-b2", Q05, 2, 512, sets=D),
    Row("0.5b-fp32-b16", Q05, 16, 512, sets=("all",)),
    Row("0.5b-sgdm-forloop-b8", Q05, 8, 512, optimizer="sgd-momentum", impl="for-loop", sets=("all",)),
    Row("0.5b-ckpt-amp-b16", Q05, 16, 2048, dtype="bf16", amp=True, ckpt=True, sets=D),
    Row("0.5b-ckpt-fp32-b8", Q05, 8, 1024, ckpt=True, sets=("all",)),
    Row("0.5b-eager-fp32-b4", Q05, 4, 512, attn="eager", sets=D),
    Row("0.5b-eager-bf16-b4", Q05, 4, 1024, dtype="bf16", attn="eager", sets=("all",)),
    Row("0.5b-bf16-b1-long", Q05, 1, 8192, dtype="bf16", sets=("all",)),
    # multi-head attention (fp32 -> memory-efficient kernel), untied embedding
    Row("mha-fp32-b8", MHA, 8, 1024, sets=D),
    Row("mha-bf16-b16", MHA, 16, 1024, dtype="bf16", sets=D),
    Row("mha-amp-ckpt-b16", MHA, 16, 2048, dtype="bf16", amp=True, ckpt=True, sets=("all",)),
    # each optimizer's own default (foreach=None, fused=None): Adafactor runs the for-loop (issue 19: +29.9%)
    Row("0.5b-adafactor-default-b1-mean", Q05, 1, 128, optimizer="adafactor", impl=None, loss="mean", sets=Q),
    Row("0.5b-adafactor-default-b8", Q05, 8, 512, optimizer="adafactor", impl=None, sets=D),
    Row("0.5b-adamw-default-b2-mean", Q05, 2, 256, impl=None, loss="mean", sets=D),
    # sliding-window attention past the window: HF passes a mask; both modes count sdpa's
    # memory-efficient kernel with the mask as a bias (issue 19: the modes disagreed 2-4x)
    Row("mistral-sw-bf16-b4", MSW, 4, 2048, dtype="bf16", sets=Q),
    Row("mistral-sw-fp32-b2", MSW, 2, 1024, sets=D),
    Row("mistral-sw-short-b8", MSW, 8, 256, dtype="bf16", sets=D),      # below the window: no mask
    # mixtures of experts (issue 19): every expert's state, the routed top-k's activations
    # (transformers' grouped_mm experts: CUTLASS in bf16 on sm90, a loop in fp32)
    Row("moe-mixtral-bf16-b8", MIXT, 8, 1024, dtype="bf16", sets=D),
    Row("moe-mixtral-bf16-b16-mean", MIXT, 16, 1024, dtype="bf16", loss="mean", sets=D),   # peak in an MoE backward
    Row("moe-mixtral-fp32-b4", MIXT, 4, 512, sets=D),
    Row("moe-mixtral-bf16-b1-mean", MIXT, 1, 128, dtype="bf16", loss="mean", sets=D),
    Row("moe-qwen2-bf16-b8", Q2M, 8, 1024, dtype="bf16", impl="fused", sets=D),
    Row("moe-qwen3-bf16-b8", Q3M, 8, 1024, dtype="bf16", sets=D),
    Row("moe-qwen3-adafactor-b4", Q3M, 4, 512, dtype="bf16", optimizer="adafactor", impl=None, sets=D),
    # the layers as the peak (2 layers, vocabulary 1024): math attention's backward in an MoE layer
    # (fp32 grouped-query attention), the routing-weight product's (mixtral bf16) and the inverse
    # permutation's (qwen3_moe bf16) backward; on CPU the formula is -0.02..-0.10% of --measure
    Row("moe-mixtral-2l-fp32-b4-mean", "moe/mixtral-2l-v1k", 4, 1024, loss="mean"),
    Row("moe-mixtral-2l-bf16-b4-mean", "moe/mixtral-2l-v1k", 4, 1024, dtype="bf16", loss="mean"),
    Row("moe-qwen3-2l-fp32-b4-mean", "moe/qwen3-moe-2l-v1k", 4, 1024, loss="mean"),
    Row("moe-qwen3-2l-bf16-b4-mean", "moe/qwen3-moe-2l-v1k", 4, 1024, dtype="bf16", loss="mean"),
    # GPT-2 family: approximate analytical formula (dropout, GELU); --measure counts it exactly
    Row("gpt2-fp32-b8", GPT2, 8, 1024, sets=D),
    Row("gpt2-amp-b16", GPT2, 16, 1024, dtype="bf16", amp=True, sets=("all",)),
]


# Issue 34: architectures the rows above do not use, configs written from the published ones (layers
# cut where the model would not fit the time), in both modes: attention dropout (math in fp32, flash
# in bf16), sdpa's math kernel in bf16 (its fp32 upcast), eager at a long sequence, MLA, a
# multimodal config (refused by both modes: the row says so), and types only --measure builds.
HD = ("held",)
H = "held/"
ROWS += [
    Row("held-llama3.2-1b-math-bf16", H + "llama-3.2-1b", 2, 1024, dtype="bf16", attn="math", sets=HD),
    Row("held-llama3.2-1b-bf16", H + "llama-3.2-1b", 4, 1024, dtype="bf16", attn=None, sets=HD),
    Row("held-granite-dropout-fp32", H + "granite-3.1-2b-10l", 2, 1024, attn=None, sets=HD),
    Row("held-granite-dropout-bf16", H + "granite-3.1-2b-10l", 4, 1024, dtype="bf16", attn=None, sets=HD),
    Row("held-qwen2.5-dropout-fp32", H + "qwen2.5-0.5b-dropout", 2, 512, attn=None, sets=HD),
    Row("held-qwen3-eager-long-bf16", H + "qwen3-0.6b-12l", 1, 4096, dtype="bf16", attn="eager", sets=HD),
    Row("held-mistral-nemo-bf16", H + "mistral-nemo-4l", 2, 2048, dtype="bf16", attn=None, sets=HD),
    Row("held-gpt2-medium-xattn", H + "gpt2-medium-xattn", 4, 1024, attn=None, sets=HD),
    Row("held-deepseek-v2-mla-bf16", H + "deepseek-v2-lite-4l", 2, 1024, dtype="bf16", attn=None, sets=HD),
    Row("held-deepseek-v2-mla-fp32", H + "deepseek-v2-lite-4l", 1, 512, attn=None, sets=HD),
    Row("held-deepseek-v3-mla-bf16", H + "deepseek-v3-4l-e32", 1, 1024, dtype="bf16", attn=None, sets=HD),
    Row("held-llava-1.5-7b", H + "llava-1.5-7b", 1, 512, dtype="fp16", attn=None, sets=HD),
    Row("held-bloom-560m", H + "bloom-560m", 4, 512, attn=None, sets=HD),
    Row("held-gptj-bf16", H + "gptj-6b-4l", 2, 1024, dtype="bf16", attn=None, sets=HD),
    Row("held-opt-350m", H + "opt-350m", 4, 1024, attn=None, sets=HD),
    Row("held-mamba-130m", H + "mamba-130m-6l", 4, 512, attn=None, sets=HD),
    Row("held-phi3-mini-bf16", H + "phi3-mini-6l", 4, 2048, dtype="bf16", attn=None, sets=HD),
]
# MLA (DeepSeek-V2/V3) where the layers are the peak (vocabulary cut to 1024): the formula's MoE
# backward, routed-output forward, attention backward and checkpointing against the GPU
ML = ("mla",)
V2L, V3N = "mla/deepseek-v2-lite-2l-v1k", "mla/deepseek-v3-2l-h2048"
ROWS += [
    Row("mla-v2-lite-bf16-b8-mean", V2L, 8, 1024, dtype="bf16", loss="mean", attn=None, sets=ML),
    Row("mla-v2-lite-fp32-b8-mean", V2L, 8, 1024, loss="mean", attn=None, sets=ML),
    Row("mla-v2-lite-eager-bf16-b2", V2L, 2, 2048, dtype="bf16", loss="mean", attn="eager", sets=ML),
    Row("mla-v2-lite-ckpt-bf16-b16", V2L, 16, 1024, dtype="bf16", ckpt=True, attn=None, sets=ML),
    Row("mla-v3-narrow-bf16-b8", V3N, 8, 1024, dtype="bf16", attn=None, sets=ML),
    Row("mla-v3-narrow-fp32-b4-mean", V3N, 4, 1024, loss="mean", attn=None, sets=ML),
]
TINY = False      # --tiny: every row shrunk (1-2 layers, a 1024 vocabulary, batch 1, seq 32) to run on a CPU


def config_dict(row: Row) -> dict:
    """The row's config.json as a dict (shrunk with --tiny)."""
    cfg = json.loads((CONFIGS / f"{row.config}.json").read_text())
    if TINY:
        moe = any(cfg.get(k) for k in ("n_routed_experts", "num_local_experts", "num_experts"))
        for part in [cfg] + [cfg[k] for k in ("text_config",) if isinstance(cfg.get(k), dict)]:
            for k in ("num_hidden_layers", "n_layer"):
                if k in part:
                    part[k] = 2 if moe else 1
            if "vocab_size" in part:
                part["vocab_size"] = 1024
            for k, most in (("n_routed_experts", 4), ("num_experts_per_tok", 2), ("intermediate_size", 1024),
                            ("moe_intermediate_size", 256), ("ffn_dim", 1024), ("n_inner", 1024),
                            ("n_group", 2), ("topk_group", 1)):      # DeepSeek-V3: groups dividing the 4 experts
                if isinstance(part.get(k), int):
                    part[k] = min(part[k], most)
            for k in ("pad_token_id", "bos_token_id", "eos_token_id"):
                if isinstance(part.get(k), int) and part[k] >= 1024:
                    part[k] = 0
        if "layer_types" in cfg:
            cfg["layer_types"] = cfg["layer_types"][:2]
    return cfg


def config_path(row: Row) -> str:
    """A file holding the row's config (a shrunk copy with --tiny)."""
    if not TINY:
        return str(CONFIGS / f"{row.config}.json")
    import tempfile
    d = Path(tempfile.gettempdir()) / "gpumon-estimate-tiny"
    d.mkdir(exist_ok=True)
    p = d / (row.config.replace("/", "_") + ".json")
    tmp = d / f".{p.name}.{os.getpid()}"
    tmp.write_text(json.dumps(config_dict(row)))
    os.replace(tmp, p)      # whole or not at all: the --measure workers read it meanwhile
    return str(p)


def select(rows_set: str, only: list[str] | None) -> list[Row]:
    rows = [r for r in ROWS if rows_set in r.sets]
    if only:
        keys = [o.lower() for o in only]
        rows = [r for r in rows if any(k in r.name.lower() or k in r.label().lower() for k in keys)]
    return rows


def build(torch, transformers, row: Row, device: str = "cuda"):
    cfg = config_dict(row)
    mt = cfg.pop("model_type")
    cfg["use_cache"] = False
    config = transformers.AutoConfig.for_model(mt, **cfg)
    wdtype = torch.float32 if (row.amp or row.dtype == "fp32") else getattr(torch, {"bf16": "bfloat16", "fp16": "float16"}[row.dtype])
    kw = {} if row.attn is None else {"attn_implementation": "eager" if row.attn == "eager" else "sdpa"}
    with torch.device(device):
        try:
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=wdtype, **kw)
        except TypeError:
            model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=wdtype, **kw)
    model = model.to(device=device, dtype=wdtype)
    model.train()
    if row.ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model, config


def sdpa_kernel(torch, row: Row):
    """The sdpa kernel a row forces (--attn math/flash/efficient), or no constraint."""
    import contextlib
    if row.attn not in ("math", "flash", "efficient"):
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel as kernel
    return kernel({"math": SDPBackend.MATH, "flash": SDPBackend.FLASH_ATTENTION,
                   "efficient": SDPBackend.EFFICIENT_ATTENTION}[row.attn])


def make_optimizer(torch, row: Row, params):
    kw = {"foreach": row.impl == "foreach"}
    if row.impl == "fused":
        kw = {"fused": True}
    elif row.impl is None:
        kw = {}
    if row.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=1e-5, **kw)
    if row.optimizer == "sgd-momentum":
        return torch.optim.SGD(params, lr=1e-4, momentum=0.9, **kw)
    if row.optimizer == "sgd":
        return torch.optim.SGD(params, lr=1e-4, **kw)
    if row.optimizer == "adafactor":
        if not hasattr(torch.optim, "Adafactor"):
            raise RuntimeError(f"torch {torch.__version__} has no torch.optim.Adafactor")
        if row.impl == "fused":
            raise ValueError("Adafactor has no fused implementation")
        return torch.optim.Adafactor(params, lr=1e-2, **kw)
    raise ValueError(row.optimizer)


def leftover_bytes(torch) -> int:
    """Bytes still allocated by earlier work in this process (a model in reference cycles, a test's
    tensors), after a collection and without the cuBLAS workspaces (the estimate counts those, and
    the first step makes them again). A row's peak is measured above this."""
    gc.collect()
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        torch.cuda.synchronize()
        clear()
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated()


def _requested(meas: dict | None) -> int | None:
    """The row's requested peak, what the estimate predicts (max_memory_allocated where torch
    gives no requested_bytes)."""
    return (meas.get("requested") or meas["peak"]) if meas else None


def _outside(est: dict, meas: dict | None) -> str:
    """' outside' when max_memory_allocated is not in the estimate's predicted range for it."""
    if not est or not meas or not est.get("allocated_range") or meas.get("peak") is None:
        return ""
    lo, hi = est["allocated_range"]
    return "" if lo <= meas["peak"] <= hi else " outside"


def measure_row(torch, transformers, row: Row, steps: int, device: str = "cuda") -> dict:
    if device == "cpu":      # --tiny on a CPU: the code paths only (no allocator figures)
        model, config = build(torch, transformers, row, "cpu")
        opt = make_optimizer(torch, row, model.parameters())
        ids = torch.randint(0, config.vocab_size, (row.batch, row.seq))
        t0 = time.perf_counter()
        for _ in range(1 + steps):
            with sdpa_kernel(torch, row):
                loss = model(input_ids=ids, labels=ids).loss if row.loss == "ce" else model(input_ids=ids).logits.mean()
                loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        n = sum(p.numel() for p in model.parameters())
        return {"peak": None, "reserved": None, "nvml": None, "requested": None, "leftover": 0,
                "step_s": (time.perf_counter() - t0) / (1 + steps), "n_params": n}
    leftover = leftover_bytes(torch)
    model, config = build(torch, transformers, row)
    opt = make_optimizer(torch, row, model.parameters())
    n_params = sum(p.numel() for p in model.parameters())
    ids = torch.randint(0, config.vocab_size, (row.batch, row.seq), device="cuda")
    amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(row.dtype)

    def step():
        with sdpa_kernel(torch, row):
            with torch.autocast("cuda", dtype=amp_dtype, enabled=row.amp):
                if row.loss == "ce":
                    loss = model(input_ids=ids, labels=ids).loss
                else:
                    loss = model(input_ids=ids).logits.mean()
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / steps
    peak = torch.cuda.max_memory_allocated() - leftover
    reserved = torch.cuda.max_memory_reserved()
    # the peak of the bytes the tensors asked for, before the allocator rounds them to its blocks
    # (512 B multiples, and a whole cached block when less than 1 MiB of it would be left over):
    # max_memory_allocated counts the blocks (CUDACachingAllocator.cpp: stats use block->size)
    requested = torch.cuda.memory_stats().get("requested_bytes.all.peak")
    if requested is not None:
        requested -= leftover   # (close enough: the leftovers' own rounding is a few hundred bytes)
    nvml = None
    try:
        import pynvml
        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        import os
        for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h):
            if p.pid == os.getpid() and p.usedGpuMemory:
                nvml = int(p.usedGpuMemory)
        if nvml is None:
            nvml = int(pynvml.nvmlDeviceGetMemoryInfo(h).used)
    except Exception:
        pass
    del model, opt, ids
    gc.collect()
    torch.cuda.empty_cache()
    return {"peak": peak, "reserved": reserved, "nvml": nvml, "step_s": dt, "requested": requested,
            "leftover": leftover, "n_params": n_params}


def estimate_row(row: Row, measure: bool) -> dict:
    """Both modes for one row. A mode that refuses the config (a type the formula does not model, a
    multimodal config) gives its one line instead of a figure."""
    from gpumon.estimate import Setup, estimate, load_config
    from gpumon.estimate.arch import NotModelled
    from gpumon.estimate.measure import MeasureError, measure_activations
    path = config_path(row)
    try:
        arch, _ = load_config(path)
    except NotModelled as exc:
        arch, refused = None, str(exc)
    else:
        refused = ""
    s = Setup(arch=arch, batch=row.batch, seq=row.seq, dtype=row.dtype, amp=row.amp, optimizer=row.optimizer,
              impl=row.impl, checkpointing=row.ckpt, attn=row.attn or _config_attn(arch), loss=row.loss,
              n_params=None if arch else 1)
    out = {"estimate": None, "phase": "-", "moment": "", "blog": None, "nvml_range": None, "measured_est": None,
           "measure_note": "", "cache": (0, 0), "impl": "-", "allocated_range": None,
           "formula_note": ("refused: " + refused.split(": ", 1)[-1])[:110] if refused else ""}
    if arch is not None:
        e = estimate(s)
        out.update({"estimate": e.peak_bytes, "phase": e.peak_phase, "moment": e.peak_moment,
                    "blog": e.blog["total_bytes"], "nvml_range": e.nvml_range, "cache": e.allocator_cache,
                    "impl": e.setup["impl"], "allocated_range": e.allocated_range, "n_params": e.n_params})
    if measure:
        if row.amp or row.ckpt:
            out["measure_note"] = "n/a (autocast/checkpointing: analytical only)"
        else:
            try:
                m = measure_activations(row.batch, row.seq, row.dtype, config=path, attn=row.attn)
                from dataclasses import replace
                em = estimate(replace(s, measured=m, activations="measured", arch=None, n_params=None))
                out["measured_est"] = em.peak_bytes
                out.setdefault("n_params", em.n_params)
                if out["allocated_range"] is None:
                    out["allocated_range"] = em.allocated_range
            except MeasureError as exc:
                out["measure_note"] = f"refused: {str(exc).split(': ', 1)[-1]}"[:110]
    return out


def take_measured(est: dict, got: dict) -> None:
    """Put a --measure worker's answer into the row's estimate. Where the formula refused, the
    predicted range for max_memory_allocated is --measure's (it read (0.00-0.00 outside) on every
    such row of the H100's held table)."""
    est["measured_est"], est["measure_note"] = got.get("measured_est"), got.get("measure_note", "")
    if est.get("allocated_range") is None and got.get("measured_est") is not None:
        est["allocated_range"] = got.get("allocated_range")


def _config_attn(arch) -> str:
    impl = arch.extra.get("attn_implementation") if arch is not None else None
    return {"eager": "eager", "flash_attention_2": "flash"}.get(impl, "sdpa")


def _init_worker() -> None:
    import torch
    torch.set_num_threads(2)   # several rows are measured at once on the CPU while the GPU trains


def measure_only(row: Row, tiny: bool = False) -> dict:
    """The --measure column of one row (CPU only: fake tensors), run in a worker process."""
    global TINY
    TINY = tiny
    try:
        return estimate_row(row, True)
    except Exception as exc:  # reported in the table, never fatal
        return {"measured_est": None, "measure_note": f"n/a ({type(exc).__name__}: {exc})"[:120]}


def gib(b) -> str:
    return "-" if b is None else f"{b / 2**30:.2f}"


def err(est, meas) -> str:
    if est is None or not meas:
        return "-"
    return f"{100 * (est - meas) / meas:+.2f}%"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="default", choices=("quick", "default", "all", "held", "mla"))
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                    help="cpu (with --tiny): run every code path on a CPU first (no allocator figures)")
    ap.add_argument("--tiny", action="store_true", help="shrink every row (1-2 layers, vocab 1024, batch 1, seq 32)")
    ap.add_argument("--only", action="append",
                    help="rows whose name or label contains this (repeatable: any of them)")
    ap.add_argument("--steps", type=int, default=2, help="steps measured after the first (default 2)")
    ap.add_argument("--no-measure", action="store_true", help="skip the --measure (fake tensors) column")
    ap.add_argument("--budget-s", type=float, default=270,
                    help="stop starting GPU rows after this many seconds (default 270: the run ends within 6 min)")
    ap.add_argument("--workers", type=int, default=4, help="processes for the --measure column (CPU, in parallel)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "estimate_accuracy.md"))
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--truth", metavar="TABLE.md",
                    help="held/mla rows: take the GPU's figures from an earlier run's table (its "
                         "requested and max_memory_allocated columns, 0.01 GiB) and compute the "
                         "estimates here, on the CPU (neither mode needs a GPU)")
    a = ap.parse_args(argv)
    global TINY
    TINY = a.tiny
    rows = select(a.rows, a.only)
    if a.tiny:
        from dataclasses import replace
        rows = [replace(r, batch=1, seq=32) for r in rows]
        a.budget_s = max(a.budget_s, 3600)    # a CPU run of every row: no GPU time to keep to
    if a.list:
        for r in rows:
            print(f"{r.name:22s} {r.label()}")
        return 0
    t_start = time.perf_counter()
    if a.truth:
        return estimates_against(a, rows, t_start)
    import torch
    if a.device == "cuda" and not torch.cuda.is_available():
        print("needs CUDA (or --device cpu --tiny)", file=sys.stderr)
        return 2
    import transformers
    pool, pending = None, {}
    if not a.no_measure:
        # fake-tensor measurements are CPU work: run them beside the GPU rows (spawned before CUDA
        # is initialised in this process)
        pool = multiprocessing.get_context("spawn").Pool(max(1, a.workers), initializer=_init_worker)
        pending = {r.name: pool.apply_async(measure_only, (r, a.tiny)) for r in rows if not (r.amp or r.ckpt)}
    results = []
    for r in rows:
        if time.perf_counter() - t_start > a.budget_s:
            results.append((r, None, None, "skipped (time budget)"))
            continue
        t0 = time.perf_counter()
        try:
            est = estimate_row(r, False)
        except Exception as exc:   # a row whose estimate fails is reported, not fatal
            results.append((r, None, None, f"estimate failed: {type(exc).__name__}: {exc}"[:160]))
            print(f"{r.name:26s} estimate failed: {type(exc).__name__}: {exc}", flush=True)
            continue
        if r.amp or r.ckpt:
            est["measure_note"] = "n/a (autocast/checkpointing: analytical only)"
        from gpumon.estimate.arch import multimodal_refusal
        if multimodal_refusal(config_dict(r)):    # both modes refuse it: nothing to compare on the GPU
            results.append((r, est, None, "refused by both modes (one line): vision tower not modelled"))
            print(f"{r.name:26s} refused by both modes: {est['formula_note']}", flush=True)
            continue
        try:
            meas = measure_row(torch, transformers, r, a.steps, a.device)
            note = ""
        except torch.OutOfMemoryError:
            meas, note = None, "OOM"
            gc.collect()
            torch.cuda.empty_cache()
        except Exception as exc:  # a row that cannot run is reported, not fatal
            meas, note = None, f"failed: {type(exc).__name__}: {exc}"[:160]
            gc.collect()
            torch.cuda.empty_cache()
        results.append((r, est, meas, note))
        req = _requested(meas) if meas and meas.get("peak") is not None else None
        line = (f"{r.name:26s} est {gib(est['estimate'])} GiB  requested {gib(req)} GiB  "
                f"err {err(est['estimate'], req)}  max_memory_allocated {gib(meas and meas['peak'])} GiB"
                f"{_outside(est, meas)}  ({time.perf_counter() - t0:.1f}s) {note}")
        print(line, flush=True)
    if pool is not None:
        for r, est, meas, note in results:
            job = pending.get(r.name)
            if est is None or job is None:
                continue
            left = max(0.0, a.budget_s + 45 - (time.perf_counter() - t_start))
            try:
                take_measured(est, job.get(timeout=left))
            except multiprocessing.TimeoutError:
                est["measure_note"] = "n/a (time budget)"
            print(f"{r.name:26s} --measure estimate {gib(est['measured_est'])} GiB "
                  f"err {err(est['measured_est'], _requested(meas))} "
                  f"{est['measure_note']}", flush=True)
        pool.terminate()
    total = time.perf_counter() - t_start
    if a.rows in ("held", "mla"):      # both modes, as the held-out table
        write_held_md(a.out, results, torch, transformers, total, a)
        return 0
    write_md(a.out, results, torch, transformers, total, a)
    # rows with a measured peak (a CPU try has none)
    both = [(e, m) for _, e, m, _ in results if e and m and _requested(m)]
    errs = [abs(e["estimate"] - _requested(m)) / _requested(m) for e, m in both]
    outside = sum(1 for e, m in both if _outside(e, m))
    if errs:
        print(f"worst |error| (analytical vs requested): {100 * max(errs):.2f}% over {len(errs)} rows; "
              f"max_memory_allocated outside its predicted range: {outside}; {total:.0f} s")
    return 0


def read_truth(path: str) -> tuple[dict, str]:
    """{row label: {"requested": B, "peak": B}} from a held table written on a GPU (GiB to 0.01),
    and its "Machine: ..." line."""
    truth, machine = {}, ""
    for line in Path(path).read_text().splitlines():
        if line.startswith("Machine:"):
            machine = line.split(" Run:")[0]
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 9 or not cells[0].startswith(("held/", "mla/")):
            continue
        try:
            req, peak = float(cells[6]), float(cells[7].split()[0])
        except ValueError:
            continue
        truth[cells[0]] = {"requested": int(req * 2**30), "peak": int(peak * 2**30)}
    return truth, machine


def estimates_against(a, rows, t_start) -> int:
    """--truth: today's estimates (formula and --measure, here) against an earlier GPU run's
    figures for the same rows."""
    import torch
    import transformers
    truth, machine = read_truth(a.truth)
    results = []
    for r in rows:
        try:
            est = estimate_row(r, not (r.amp or r.ckpt))
        except Exception as exc:   # reported, not fatal
            results.append((r, None, None, f"estimate failed: {type(exc).__name__}: {exc}"[:160]))
            continue
        m = truth.get(r.label())
        note = "" if m else "not run on a GPU yet"
        from gpumon.estimate.arch import multimodal_refusal
        if multimodal_refusal(config_dict(r)):
            m, note = None, "refused by both modes (one line): vision tower not modelled"
        results.append((r, est, m, note))
        print(f"{r.name:26s} formula {gib(est['estimate'])} --measure {gib(est['measured_est'])} "
              f"requested {gib(m and m['requested'])} {note}", flush=True)
    a.device = "cpu"
    write_held_md(a.out, results, torch, transformers, time.perf_counter() - t_start, a,
                  truth_from=(a.truth, machine))
    return 0


def write_held_md(path, results, torch, transformers, total, a, truth_from=None):
    """Issue 34's held-out table: both modes against requested_bytes.all.peak and max_memory_allocated."""
    dev = torch.cuda.get_device_name(0) if a.device == "cuda" else f"CPU ({platform.processor() or 'cpu'})"
    lines = [
        ("# Held-out architectures: `gpumon estimate` in both modes vs the GPU" if a.rows == "held" else
         "# MLA (DeepSeek-V2/V3): `gpumon estimate` in both modes vs the GPU"),
        "",
        f"Machine: {dev}, torch {torch.__version__}, transformers {transformers.__version__}. Run: "
        f"`python benchmarks/estimate_accuracy.py --rows {a.rows}"
        + (" --device cpu --tiny" if a.tiny else "")
        + (" --truth " + truth_from[0] if truth_from else "") + f"` ({total:.0f} s)."
        + (" **Tiny CPU run: the code paths only, no allocator figures.**"
           if a.device == "cpu" and not truth_from else ""),
        *([f"", f"**The estimates were computed on this CPU machine with today's code; the GPU's figures "
           f"(requested, max_memory_allocated) are those of the earlier run in {truth_from[0]} "
           f"({truth_from[1]}), read to 0.01 GiB: an error within +-0.03% is that rounding.**"]
          if truth_from else []),
        "",
        "Configs in tests/fixtures/configs/held/, written from the published ones (layers cut where noted in the "
        "name); models built with `AutoModelForCausalLM.from_config`, the attention implementation the row names "
        "(*own*: the config's, else transformers' default), one warm-up step, then the peak of the next steps. "
        "*formula*: the analytical estimate from config.json (or its one-line refusal); *--measure*: fake tensors. "
        "Errors are against torch's `requested_bytes.all.peak`; `max_memory_allocated` is given with the "
        "estimate's predicted range for it.",
        "",
        "| configuration | parameters | formula GiB | error | --measure GiB | error | requested GiB | "
        "max_memory_allocated GiB (predicted range) | note |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r, e, m, note in results:
        if e is None:
            lines.append(f"| {r.label()} | - | - | - | - | - | - | - | {note} |")
            continue
        req = (m.get("requested") or m.get("peak")) if m else None
        n = (m or {}).get("n_params") or e.get("n_params")
        formula = gib(e["estimate"]) if e["estimate"] is not None else e.get("formula_note") or "-"
        meas = gib(e["measured_est"]) if e.get("measured_est") else (e.get("measure_note") or "-")
        alloc = "-"
        if m and m.get("peak") is not None:
            if e.get("allocated_range"):
                lo, hi = e["allocated_range"]
                inside = lo <= m["peak"] <= hi
                alloc = f"{gib(m['peak'])} ({gib(lo)}-{gib(hi)}{'' if inside else ' outside'})"
            else:       # neither mode answered: no range to be in or out of
                alloc = f"{gib(m['peak'])} (no estimate)"
        lines.append(f"| {r.label()} | {n:,} | {formula} | {err(e['estimate'], req)} | {meas} | "
                     f"{err(e.get('measured_est'), req)} | {gib(req)} | {alloc} | {note or ''} |"
                     if n else
                     f"| {r.label()} | - | {formula} | - | {meas} | - | {gib(req)} | {alloc} | {note or ''} |")
    Path(path).write_text("\n".join(lines) + "\n")
    print(f"wrote {path}")


def write_md(path, results, torch, transformers, total, a):
    # a CPU try (--device cpu --tiny) writes its table too
    dev = torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"CPU ({platform.machine()})"
    lines = [
        "# Estimate accuracy: `gpumon estimate` vs the GPU's requested and allocated peaks",
        "",
        f"Machine: {dev}, torch {torch.__version__}, transformers {transformers.__version__}, "
        f"Python {platform.python_version()}. Run: `python benchmarks/estimate_accuracy.py --rows {a.rows}"
        + "".join(f" --only {o}" for o in a.only or [])
        + (" --device cpu --tiny" if a.tiny else "") + f"` ({total:.0f} s).",
        "",
        "Models built with `AutoModelForCausalLM.from_config` (random weights, `use_cache=False`), "
        "one warm-up step, then the peak of the next steps (steady state: optimizer state allocated), "
        "above anything earlier rows left allocated. *requested*: the peak of torch's "
        "`requested_bytes`, what the estimate predicts; *max_memory_allocated* adds the allocator's "
        "block rounding (512 B multiples, whole cached blocks when less than 1 MiB would be left), "
        "which the estimate gives as a range. *estimate*: analytical formula from config.json; "
        "*--measure*: fake tensors (saved bytes and the traced step); *blog*: the blog's formula with its "
        "activation heuristic. Errors are (estimate - requested) / requested.",
        "",
        "| configuration | estimate GiB | requested GiB | error | --measure GiB | error | max_memory_allocated GiB (predicted range) | blog GiB | error | predicted phase | NVML GiB (predicted range) | cache % (predicted) | step s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    worst = (0.0, "")
    for r, e, m, note in results:
        if e is None:
            lines.append(f"| {r.label()} | - | - | - | - | - | - | - | - | {note} | - | - | - |")
            continue
        mp = _requested(m)
        if mp:
            ae = abs(e["estimate"] - mp) / mp
            if ae > worst[0]:
                worst = (ae, r.label())
        meas_est = gib(e["measured_est"]) if e["measured_est"] else (e["measure_note"] or "-")
        nv = "-"
        if m and m.get("nvml"):
            lo, hi = e["nvml_range"]
            nv = f"{gib(m['nvml'])} ({gib(lo)}-{gib(hi)})"
        cache = "-"
        if m and m.get("reserved") and m.get("peak"):
            lo_c, hi_c = e.get("cache", (0, 0))
            cache = f"{100 * (m['reserved'] - m['peak']) / m['peak']:.0f}% ({100 * lo_c:.0f}-{100 * hi_c:.0f}%)"
        alloc = "-"
        if m:
            lo_a, hi_a = e.get("allocated_range") or (0, 0)
            alloc = f"{gib(m['peak'])} ({gib(lo_a)}-{gib(hi_a)}{_outside(e, m)})"
        lines.append(f"| {r.label()} | {gib(e['estimate'])} | {gib(mp) if m else note} | {err(e['estimate'], mp)} | "
                     f"{meas_est} | {err(e['measured_est'], mp)} | {alloc} | {gib(e['blog'])} | {err(e['blog'], mp)} | "
                     f"{e['phase']}: {e['moment']} | {nv} | {cache} | {m['step_s']:.2f} |" if m else
                     f"| {r.label()} | {gib(e['estimate'])} | {note} | - | {meas_est} | - | - | {gib(e['blog'])} | - | "
                     f"{e['phase']} | - | - | - |")
    outside = sum(1 for _, e, m, _ in results if e and m and _outside(e, m))
    lines += ["", f"Worst case (analytical estimate vs requested): {100 * worst[0]:.2f}% on {worst[1] or '-'}. "
              f"Rows whose max_memory_allocated is outside its predicted range: {outside}.", ""]
    Path(path).write_text("\n".join(lines))
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
