"""`--measure`: build the model without memory (fake tensors) and count what autograd saves.

The model runs one forward under `torch.autograd.graph.saved_tensors_hooks`; every tensor autograd
packs is recorded by its storage (views share one), parameters and buffers are left out, and
the bytes of the distinct storages are what the forward leaves for backward: exact for the ops
that run, with no GPU and no memory used. Backward then runs once to check the graph is whole.

The model is built and run under torch's FakeTensorMode (tensors with shapes, dtypes and storages
but no data; `device="meta"` is the alternative, which cannot run code that enters
`torch.autocast(...)` on its tensors' device, as Hugging Face's rotary embedding does).

Attention: without a GPU `scaled_dot_product_attention` would run a CPU or math kernel. On a GPU,
sdpa dispatches to flash or memory-efficient attention when it can, and those save different
tensors (q, k, v, the output and a log-sum-exp instead of the L x L probabilities). So during the
measurement sdpa is routed the way CUDA routes it (activations.resolve_attention's rules) and
flash / efficient are emulated by an autograd Function that saves exactly what those kernels save.
(Left alone, torch on fake CPU tensors would pick its CPU kernels, sdp_utils_cpp.cpp: flash, then
math.) A mask passed to sdpa is counted as the math kernel (B x H x L x L probabilities) and said.
Hugging Face's mask code would pass one on fake tensors where a GPU run passes none: see
_OneSequencePerRow.

torch is imported inside the functions (importlib), never at module import: gpumon.estimate must
stay importable without torch.
"""
from __future__ import annotations

import importlib
import sys
from typing import Any, Callable


class MeasureError(RuntimeError):
    """The model could not be measured (one clear line, with what to do instead)."""


DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def _torch():
    try:
        return importlib.import_module("torch")
    except ImportError:
        raise MeasureError("--measure needs torch installed here (pip install torch); "
                           "without it use --config for the analytical formula") from None


def load_factory(spec: str) -> Callable[..., Any]:
    """'pkg.mod:factory' -> the callable (the current directory is importable, like python -m)."""
    if ":" not in spec:
        raise MeasureError(f"--model wants pkg.module:factory, got {spec!r}")
    mod_name, _, attr = spec.partition(":")
    if "" not in sys.path and "." not in sys.path:
        sys.path.insert(0, "")
    try:
        mod = importlib.import_module(mod_name)
    except Exception as e:  # the user's module: any error is theirs, reported in one line
        raise MeasureError(f"cannot import {mod_name!r}: {type(e).__name__}: {e}") from None
    fn = mod
    for part in attr.split("."):
        fn = getattr(fn, part, None)
        if fn is None:
            raise MeasureError(f"{mod_name} has no {attr!r}")
    if not callable(fn):
        raise MeasureError(f"{spec} is not callable")
    return fn


def _sdpa_router(torch, original):
    """Replacement for F.scaled_dot_product_attention that saves what the CUDA kernel would."""
    F = torch.nn.functional

    class _FusedAttention(torch.autograd.Function):
        # flash / memory-efficient: save q, k, v, out, logsumexp; out is laid out as [B, L, H, D]
        @staticmethod
        def forward(ctx, q, k, v, is_causal, scale, gqa):
            with torch.no_grad():
                out = original(q, k, v, is_causal=is_causal, scale=scale, enable_gqa=gqa)
            B, H, L, D = out.shape
            out_bl = torch.empty((B, L, H, D), dtype=out.dtype, device=out.device).transpose(1, 2)
            out_bl.copy_(out)
            lse = torch.empty((B, H, -(-L // 32) * 32), dtype=torch.float32, device=q.device)
            ctx.save_for_backward(q, k, v, out_bl, lse)
            ctx.args = (is_causal, scale, gqa)
            return out_bl

        @staticmethod
        def backward(ctx, grad):
            q, k, v, out, lse = ctx.saved_tensors
            return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), None, None, None

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        half = query.dtype in (torch.float16, torch.bfloat16)
        grad = torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad)
        gqa_needed = key.shape[-3] != query.shape[-3]
        if attn_mask is not None:
            sdpa.masked += 1
        if not grad or attn_mask is not None:
            kernel = "math"
        elif half and query.shape[-1] <= 256:
            kernel = "flash"
        elif gqa_needed:
            kernel = "math"
        else:
            kernel = "efficient"
        sdpa.kernels.add(kernel)
        if kernel == "math":
            out = torch.ops.aten._scaled_dot_product_attention_math(
                query, key, value, attn_mask, dropout_p, is_causal, None, scale=scale, enable_gqa=enable_gqa)
            return out[0]
        # flash / efficient with dropout keep only a philox seed and offset: nothing parameter-sized more
        return _FusedAttention.apply(query, key, value, is_causal, scale, enable_gqa)

    sdpa.kernels = set()
    sdpa.masked = 0
    return sdpa


class _OneSequencePerRow:
    """Hugging Face's mask code decides on a GPU what it cannot decide on fake tensors.

    transformers (5.x) `masking_utils.find_packed_sequence_indices(position_ids)` returns None (no
    packed sequences, so the causal mask is skipped and sdpa runs with is_causal=True and, for
    grouped-query models, enable_gqa) only `if not is_tracing(mask) and (mask[:, -1] == 0).all()`;
    and its `is_tracing` is True for a FakeTensor. So on fake tensors HF builds a 4-D boolean mask,
    repeats k and v, and sdpa gets attn_mask: the math kernel with its B x H x L x L probabilities,
    not what the GPU runs (+44..98% on the s1024 rows of benchmarks/estimate_accuracy.md).
    The input --measure makes (token ids, no position_ids) is one sequence per row, for which the
    real answer is None: every loaded transformers module's find_packed_sequence_indices says so
    for the duration of the measurement.
    """

    def __enter__(self):
        self.patched = []
        for name, mod in list(sys.modules.items()):
            if mod is None or not (name == "transformers" or name.startswith("transformers.")):
                continue
            fn = getattr(mod, "find_packed_sequence_indices", None)
            if callable(fn):
                self.patched.append((mod, fn))
                setattr(mod, "find_packed_sequence_indices", lambda position_ids, *a, **k: None)
        return self

    def __exit__(self, *exc):
        for mod, fn in self.patched:
            setattr(mod, "find_packed_sequence_indices", fn)
        return False


def build_from_config(torch, config_path: str, dtype, attn: str):
    try:
        transformers = importlib.import_module("transformers")
    except ImportError:
        raise MeasureError("--measure with --config needs transformers installed (pip install transformers); "
                           "without it the analytical formula is used when --measure is left out") from None
    import json
    from pathlib import Path
    p = Path(config_path)
    cfg = json.loads((p / "config.json" if p.is_dir() else p).read_text())
    cfg["use_cache"] = False          # a training forward does not need the KV cache
    mt = cfg.pop("model_type", None)
    if not mt:
        raise MeasureError(f"{config_path} has no model_type")
    config = transformers.AutoConfig.for_model(mt, **cfg)
    impl = "eager" if attn == "eager" else "sdpa"
    try:
        return transformers.AutoModelForCausalLM.from_config(config, torch_dtype=dtype, attn_implementation=impl)
    except TypeError:
        return transformers.AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=impl)


def measure_activations(batch: int, seq: int, dtype: str = "fp32", model: str | None = None,
                        config: str | None = None, attn: str = "sdpa", device: str = "fake",
                        factory: Callable[..., Any] | None = None, amp: bool = False) -> dict:
    """Count autograd's saved bytes for one forward of the model at (batch, seq).

    The factory is called as factory() (or factory(batch=..., seq=...) if it accepts them) and
    returns an nn.Module; its input is `module.example_input(batch, seq)` when the module (or the
    factory's module) defines `example_input`, else token ids [batch, seq] below the config's vocab.
    """
    torch = _torch()
    if amp:
        raise MeasureError("autocast cannot run on the meta device, so --measure cannot count it; "
                           "leave out --measure to use the analytical formula for --amp")
    tdtype = getattr(torch, DTYPES[dtype])
    if device == "fake":
        # FakeTensorMode: CPU-typed tensors with no data. Unlike the meta device it lets code such as
        # Hugging Face's rotary embedding enter `torch.autocast(device_type=..., enabled=False)`.
        fake_tensor = importlib.import_module("torch._subclasses.fake_tensor")
        dev = fake_tensor.FakeTensorMode()
    else:
        dev = torch.device(device)
    example = None
    old_default = torch.get_default_dtype()
    try:
        torch.set_default_dtype(tdtype)    # build in the target dtype: .to() cannot swap fake parameters
        with dev:
            if factory is None and model:
                factory = load_factory(model)
            if factory is not None:
                try:
                    net = factory(batch=batch, seq=seq)
                except TypeError:
                    net = factory()
                mod = sys.modules.get(getattr(factory, "__module__", ""), None)
                example = getattr(net, "example_input", None) or getattr(mod, "example_input", None)
            elif config:
                net = build_from_config(torch, config, tdtype, attn)
            else:
                raise MeasureError("--measure needs --model pkg.mod:factory or --config")
            if any(p.dtype != tdtype for p in net.parameters() if p.is_floating_point()):
                net = net.to(dtype=tdtype)
            net.train()
            if example is not None:
                inp = example(batch, seq)
            else:
                vocab = getattr(getattr(net, "config", None), "vocab_size", None) or getattr(net, "vocab_size", None)
                if not vocab:
                    raise MeasureError("cannot tell the model's input: define example_input(batch, seq) "
                                       "next to the factory")
                inp = torch.zeros((batch, seq), dtype=torch.long)
    except MeasureError:
        raise
    except Exception as e:
        raise MeasureError(f"could not build the model on {device}: {type(e).__name__}: {e}") from None
    finally:
        torch.set_default_dtype(old_default)

    params = [p for _, p in net.named_parameters(remove_duplicate=False)]
    by_storage: dict[int, tuple[int, bool, int]] = {}
    for p in params:
        key = p.untyped_storage()._cdata
        prev = by_storage.get(key)
        by_storage[key] = (p.numel(), p.requires_grad or (prev[1] if prev else False), p.numel())
    param_keys = set(by_storage)
    buffer_keys = {b.untyped_storage()._cdata for b in net.buffers()}
    n_params = sum(v[0] for v in by_storage.values())
    n_train = sum(v[0] for v in by_storage.values() if v[1])
    largest = max((v[0] for v in by_storage.values()), default=0)
    largest_train = max((v[0] for v in by_storage.values() if v[1]), default=0)
    tied = len(by_storage) < len(params)
    head_numel = 0
    get_out = getattr(net, "get_output_embeddings", None)
    if callable(get_out) and get_out() is not None:
        head_numel = get_out().weight.numel()

    saved: dict[int, int] = {}
    kinds: dict[str, int] = {}

    def pack(t):
        try:
            st = t.untyped_storage()
            key = st._cdata
        except Exception:   # a tensor without storage (e.g. a wrapper subclass): count its bytes
            key, st = id(t), None
        if key in param_keys or key in buffer_keys:
            return t
        if key not in saved:
            saved[key] = st.nbytes() if st is not None else t.numel() * t.element_size()
            kinds[str(t.dtype)] = kinds.get(str(t.dtype), 0) + saved[key]
        return t

    F = torch.nn.functional
    original = F.scaled_dot_product_attention
    router = _sdpa_router(torch, original) if attn in ("sdpa", "flash", "efficient") else None
    import contextlib
    # our own input (token ids, no position_ids) is one sequence per row: say so to HF's mask code
    one_seq = _OneSequencePerRow() if example is None else contextlib.nullcontext()
    try:
        if router:
            F.scaled_dot_product_attention = router
        with one_seq, dev, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = net(inp)
        logits = out
        if not torch.is_tensor(logits):
            logits = getattr(out, "logits", None)
            if logits is None and isinstance(out, (tuple, list)):
                logits = out[0]
        if not torch.is_tensor(logits):
            raise MeasureError("the model's output is neither a tensor nor has .logits")
        logits.float().mean().backward()
    except MeasureError:
        raise
    except Exception as e:
        raise MeasureError(f"could not run forward/backward on {device}: {type(e).__name__}: {e} "
                           f"(leave out --measure to use the analytical formula)") from None
    finally:
        F.scaled_dot_product_attention = original
    notes = []
    if router and router.kernels:
        saves = {"flash": "flash (saves q, k, v, output, fp32 logsumexp)",
                 "efficient": "memory-efficient (saves q, k, v, output, fp32 logsumexp)",
                 "math": "math (saves the B x H x L x L probabilities)"}
        notes.append("attention counted as CUDA's sdpa kernel would save it: "
                     + ", ".join(saves[k] for k in sorted(router.kernels)))
    if router and router.masked:
        notes.append(f"sdpa was given an attention mask {router.masked} time(s): counted as the math kernel")
    return {
        "n_params": n_params, "n_trainable": n_train, "largest_param": largest,
        "largest_trainable": largest_train, "tied": tied, "head_numel": head_numel,
        "saved_bytes": sum(saved.values()), "saved_tensors": len(saved), "saved_by_dtype": kinds,
        "output_bytes": logits.numel() * logits.element_size(),
        "output_numel": logits.numel() if logits.dim() >= 2 and head_numel else 0,
        "attention": ", ".join(sorted(router.kernels)) if router and router.kernels else attn,
        "device": device, "notes": notes,
    }
