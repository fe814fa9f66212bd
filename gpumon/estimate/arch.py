"""Transformer architecture read from a Hugging Face config.json as plain JSON (no transformers needed).

Two families are understood:
- "llama": decoder with RMSNorm, rotary positions, gated SiLU MLP, grouped-query attention
  (llama, qwen2, qwen3, mistral, and the like);
- "gpt2": LayerNorm, learned positions, GELU MLP, fused qkv projection.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, asdict
from pathlib import Path

LLAMA_TYPES = {"llama", "qwen2", "qwen3", "mistral", "mixtral_dense", "olmo2", "smollm3", "granite"}
GPT2_TYPES = {"gpt2"}
LINEAR_NAMES_LLAMA = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class ConfigError(ValueError):
    """A config that cannot be read or is not a supported architecture (one clear line)."""


@dataclass
class Arch:
    family: str                 # "llama" | "gpt2"
    model_type: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    max_positions: int
    tie_embeddings: bool
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    gated_mlp: bool = True
    source: str = ""
    extra: dict = field(default_factory=dict)

    # --- parameters -------------------------------------------------------------------------
    def linears(self) -> list[tuple[str, int, int, bool]]:
        """(name, in_features, out_features, has_bias) of one layer's Linear (or Conv1D) modules."""
        h, kv, i = self.hidden, self.kv_heads * self.head_dim, self.intermediate
        q = self.heads * self.head_dim
        if self.family == "gpt2":
            return [("c_attn", h, 3 * h, True), ("attn.c_proj", h, h, True),
                    ("c_fc", h, i, True), ("mlp.c_proj", i, h, True)]
        out = [("q_proj", h, q, self.qkv_bias), ("k_proj", h, kv, self.qkv_bias),
               ("v_proj", h, kv, self.qkv_bias), ("o_proj", q, h, self.o_bias)]
        if self.gated_mlp:
            out += [("gate_proj", h, i, self.mlp_bias), ("up_proj", h, i, self.mlp_bias)]
        else:
            out += [("up_proj", h, i, self.mlp_bias)]
        out.append(("down_proj", i, h, self.mlp_bias))
        return out

    def norm_params(self) -> int:
        """Parameters of one norm (RMSNorm: weight; LayerNorm: weight + bias)."""
        return self.hidden * (2 if self.family == "gpt2" else 1)

    def layer_params(self) -> int:
        lin = sum(a * b + (b if bias else 0) for _, a, b, bias in self.linears())
        return lin + 2 * self.norm_params()

    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    def position_params(self) -> int:
        return self.max_positions * self.hidden if self.family == "gpt2" else 0

    def head_params(self) -> int:
        """lm_head weight when not tied to the embedding (tied weights are one tensor, counted once)."""
        return 0 if self.tie_embeddings else self.vocab * self.hidden

    def param_count(self) -> int:
        return (self.embedding_params() + self.position_params() + self.layers * self.layer_params()
                + self.norm_params() + self.head_params())

    def linear_weight_params(self, include_head: bool = True) -> int:
        """Weights that autocast casts to low precision (Linear weights; the embedding is not cast)."""
        n = self.layers * sum(a * b for _, a, b, _ in self.linears())
        return n + (self.vocab * self.hidden if include_head else 0)

    def largest_param(self) -> int:
        """Elements of the largest single parameter tensor (the for-loop optimizers' temporaries scale with it)."""
        biggest_linear = max(a * b for _, a, b, _ in self.linears())
        return max(self.embedding_params(), biggest_linear, self.position_params())

    def lora_params(self, rank: int, targets: tuple[str, ...]) -> int:
        """Trainable parameters of LoRA adapters of rank r on the named linears of every layer."""
        n = 0
        for name, a, b, _ in self.linears():
            if any(name == t or name.endswith("." + t) or t == "all" for t in targets):
                n += rank * (a + b)
        return n * self.layers

    def to_dict(self) -> dict:
        d = asdict(self)
        d["param_count"] = self.param_count()
        return d


def _get(cfg: dict, *names, default=None):
    for n in names:
        if cfg.get(n) is not None:
            return cfg[n]
    return default


def arch_from_config(cfg: dict, source: str = "") -> Arch:
    """Build an Arch from a config dict as found in a Hugging Face config.json."""
    if "text_config" in cfg and "hidden_size" not in cfg:   # multimodal wrappers keep the LM here
        cfg = {**cfg["text_config"], "tie_word_embeddings": cfg.get("tie_word_embeddings",
                                                                    cfg["text_config"].get("tie_word_embeddings"))}
    mt = str(cfg.get("model_type", "")).lower()
    try:
        if mt in GPT2_TYPES or ("n_embd" in cfg and "n_layer" in cfg):
            h = int(cfg["n_embd"])
            heads = int(cfg["n_head"])
            return Arch(family="gpt2", model_type=mt or "gpt2", hidden=h,
                        intermediate=int(cfg.get("n_inner") or 4 * h), layers=int(cfg["n_layer"]),
                        heads=heads, kv_heads=heads, head_dim=h // heads, vocab=int(cfg["vocab_size"]),
                        max_positions=int(_get(cfg, "n_positions", "n_ctx", default=1024)),
                        tie_embeddings=bool(cfg.get("tie_word_embeddings", True)),
                        qkv_bias=True, o_bias=True, mlp_bias=True, gated_mlp=False, source=source,
                        extra={"activation": cfg.get("activation_function", "gelu_new"),
                               "dropout": float(_get(cfg, "resid_pdrop", default=0.1))})
        h = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        kv = int(_get(cfg, "num_key_value_heads", default=heads))
        head_dim = int(_get(cfg, "head_dim", default=h // heads))
        qkv_bias = bool(cfg.get("attention_bias", mt == "qwen2"))
        return Arch(family="llama", model_type=mt or "llama", hidden=h,
                    intermediate=int(cfg["intermediate_size"]), layers=int(cfg["num_hidden_layers"]),
                    heads=heads, kv_heads=kv, head_dim=head_dim, vocab=int(cfg["vocab_size"]),
                    max_positions=int(_get(cfg, "max_position_embeddings", default=2048)),
                    tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                    qkv_bias=qkv_bias, o_bias=bool(cfg.get("attention_bias", False)) and mt != "qwen2",
                    mlp_bias=bool(cfg.get("mlp_bias", False)), gated_mlp=True, source=source,
                    extra={"activation": cfg.get("hidden_act", "silu")})
    except KeyError as e:
        raise ConfigError(f"config {source or ''} lacks {e.args[0]!r}: not a decoder transformer "
                          f"config this estimator understands (llama/qwen2/mistral/gpt2 families)") from None
    except (TypeError, ValueError) as e:
        raise ConfigError(f"config {source or ''}: bad value ({e})") from None


def load_config(path: str | Path) -> tuple[Arch, dict]:
    """Read config.json (a file, or a folder holding one) as plain JSON."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    try:
        cfg = json.loads(p.read_text())
    except FileNotFoundError:
        raise ConfigError(f"no such config file: {p}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read {p}: {e}") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{p} is not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"{p} is not a JSON object")
    return arch_from_config(cfg, source=str(p)), cfg
