"""What a config.json and the command line may hold before any arithmetic runs on it.

Every number is checked before it is used, in both modes (the analytical formula and --measure,
which hands the config to transformers): a size that is not an integer, not finite, not positive
or past any real model's size is refused in one line (exit 2), so no file can make the estimate
run for minutes or grow to gigabytes. What happened without it (issue 34): `num_hidden_layers:
1e15` grew to 8.3 GB in 61 s, `1e308` sizes to 15.7 GB, a 4000-digit `hidden_size` ended in an
OverflowError traceback, a float `hidden_size` was truncated, 7 heads over a hidden size of 4096
gave 10.57B parameters and 5 kv heads over 32 heads 5.83B, all with exit 0.

The bounds are well past every published model (the largest: 126 layers, hidden 25600 for dense
decoders, 18432 for DeepSeek-V3; vocabularies up to 262k; 256 routed experts; contexts of 10M),
and far enough under what would take the estimate a noticeable time.
"""
from __future__ import annotations

import math

# key -> (lowest, highest); None values are left to the reader's own default
SIZE_BOUNDS: dict[str, tuple[int, int]] = {
    "num_hidden_layers": (1, 1024), "n_layer": (1, 1024), "num_layers": (1, 1024), "n_layers": (1, 1024),
    "hidden_size": (1, 1 << 18), "n_embd": (1, 1 << 18), "d_model": (1, 1 << 18),
    "intermediate_size": (1, 1 << 21), "n_inner": (1, 1 << 21), "ffn_dim": (1, 1 << 21),
    "moe_intermediate_size": (1, 1 << 21), "shared_expert_intermediate_size": (0, 1 << 21),
    "num_attention_heads": (1, 1 << 12), "n_head": (1, 1 << 12), "num_key_value_heads": (1, 1 << 12),
    "head_dim": (1, 1 << 12),
    "vocab_size": (1, 1 << 24),
    "max_position_embeddings": (1, 1 << 30), "n_positions": (1, 1 << 30), "n_ctx": (1, 1 << 30),
    "num_local_experts": (0, 1 << 14), "num_experts": (0, 1 << 14), "n_routed_experts": (0, 1 << 14),
    "n_shared_experts": (0, 1 << 10), "num_experts_per_tok": (1, 1 << 10),
    "sliding_window": (1, 1 << 30), "max_window_layers": (0, 1 << 10), "decoder_sparse_step": (1, 1 << 10),
    "kv_lora_rank": (1, 1 << 16), "q_lora_rank": (1, 1 << 16), "qk_rope_head_dim": (1, 1 << 12),
    "qk_nope_head_dim": (0, 1 << 12), "v_head_dim": (1, 1 << 12), "first_k_dense_replace": (0, 1 << 10),
}
# where a multimodal config keeps its parts: checked the same way
NESTED = ("text_config", "vision_config", "audio_config", "encoder", "decoder")
MAX_DIGITS = 30     # any integer anywhere in the file: past this, arithmetic on it is not bounded


class SchemaError(ValueError):
    """A number in the config or on the command line that no model has (one line, exit 2)."""


def _show(v) -> str:
    if isinstance(v, int) and not isinstance(v, bool) and len(str(abs(v))) > 20:
        return f"a {len(str(abs(v)))}-digit integer"
    return repr(v)


def _walk_numbers(obj, path: str, depth: int = 0):
    """Every number in the file, with where it is (non-finite floats and huge integers anywhere
    are refused: json accepts NaN, Infinity and integers of any length)."""
    if depth > 64:
        raise SchemaError(f"{path or 'config'}: nested more than 64 levels deep")
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _walk_numbers(v, f"{path}.{k}" if path else str(k), depth + 1)
    elif isinstance(obj, list):
        for i, v in enumerate(obj[:100000]):
            yield from _walk_numbers(v, f"{path}[{i}]", depth + 1)
    elif isinstance(obj, (int, float)) and not isinstance(obj, bool):
        yield path, obj


def check_size(name: str, v, lo: int, hi: int, where: str = "") -> int:
    """One size: an integer (not a bool, not a float), lo <= v <= hi."""
    pre = f"{where}: " if where else ""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise SchemaError(f"{pre}{name} = {_show(v)} is not a number")
    if isinstance(v, float) and not math.isfinite(v):
        raise SchemaError(f"{pre}{name} = {v} is not a finite number")
    if not lo <= v <= hi:
        raise SchemaError(f"{pre}{name} = {_show(v)} is out of range: {lo} to {hi:,} (no model has more)")
    if isinstance(v, float):
        raise SchemaError(f"{pre}{name} = {v!r} is not an integer")
    return v


def validate_config(cfg: dict, where: str = "") -> None:
    """Raise SchemaError for the first number of `cfg` no model has; the sizes' ratios too (heads
    dividing the hidden size where no head_dim is given, kv heads dividing heads)."""
    pre = f"{where}: " if where else ""
    for path, v in _walk_numbers(cfg, ""):
        if isinstance(v, float) and not math.isfinite(v):
            raise SchemaError(f"{pre}{path} = {v} is not a finite number")
        if isinstance(v, int) and len(str(abs(v))) > MAX_DIGITS:
            raise SchemaError(f"{pre}{path} is {_show(v)}: no size has that many")
    parts = [("", cfg)] + [(f"{k}.", cfg[k]) for k in NESTED if isinstance(cfg.get(k), dict)]
    for prefix, part in parts:
        for key, (lo, hi) in SIZE_BOUNDS.items():
            if part.get(key) is not None:
                check_size(prefix + key, part[key], lo, hi, where)
        _check_ratios(part, prefix, pre)


def _check_ratios(part: dict, prefix: str, pre: str) -> None:
    h = part.get("hidden_size", part.get("n_embd"))
    heads = part.get("num_attention_heads", part.get("n_head"))
    kv = part.get("num_key_value_heads")
    hname = prefix + ("hidden_size" if "hidden_size" in part else "n_embd")
    nname = prefix + ("num_attention_heads" if "num_attention_heads" in part else "n_head")
    if isinstance(h, int) and isinstance(heads, int) and part.get("head_dim") is None \
            and not part.get("kv_lora_rank") and h % heads:
        raise SchemaError(f"{pre}{nname} = {heads} does not divide {hname} = {h} (and no head_dim is given): "
                          "the heads cannot split the hidden size")
    if isinstance(heads, int) and isinstance(kv, int) and heads % kv:
        raise SchemaError(f"{pre}{prefix}num_key_value_heads = {kv} does not divide {nname} = {heads}: "
                          "grouped-query attention shares each kv head among a whole number of heads")


# the command line: (lowest, highest) for each integer option
CLI_BOUNDS: dict[str, tuple[int, int]] = {
    "batch": (1, 1 << 24), "seq": (1, 1 << 26), "grad_accum": (1, 1 << 20), "shards": (1, 1 << 20),
    "lora_rank": (0, 1 << 16),
}


def validate_cli(args) -> None:
    """The command line's integers (argparse has made them ints) within CLI_BOUNDS."""
    for name, (lo, hi) in CLI_BOUNDS.items():
        v = getattr(args, name, None)
        if v is None:
            continue
        if not lo <= v <= hi:
            flag = "--" + name.replace("_", "-")
            if v < lo:
                raise SchemaError(f"{flag} {v}: must be at least {lo}" + (" (0: no adapters)" if name == "lora_rank" else ""))
            raise SchemaError(f"{flag} {v}: must be at most {hi:,}")


def check_count(name: str, n: float, lo: int = 1, hi: int = 10**15) -> int:
    """A parameter count from the command line: finite, lo <= n <= hi."""
    if not math.isfinite(n):
        raise SchemaError(f"{name} {n}: not a finite number")
    if not lo <= n <= hi:
        raise SchemaError(f"{name} {n:g}: must be between {lo} and {hi:.0e}")
    return int(n)
