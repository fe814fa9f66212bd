"""Transformer architecture read from a Hugging Face config.json as plain JSON (no transformers needed).

Only the model types whose parameters and saved activations were checked against --measure (a
Hugging Face model counted through saved-tensor hooks; tests/estimate/test_architectures.py) are
read; any other model_type, and other mixture-of-experts configs, are refused in one line that names
--measure. Any config with a hidden_size used to be read as a Llama: Mixtral was counted as a
dense Mistral (7.24B parameters instead of 46.7B), BERT +29%, Pythia +35%, Gemma-2 -16%.

- "llama" family: decoder with RMSNorm, rotary positions, gated SiLU MLP, grouped-query
  attention: llama, qwen2, mistral, granite, qwen3 (sliding-window layers too);
  qwen3 adds an RMSNorm over head_dim on q and k;
- mixture of experts on that decoder: mixtral (Mistral attention, top-k of E experts, routing
  weights renormalised), qwen2_moe (Qwen2 attention, top-k experts + a gated shared expert,
  dense layers where mlp_only_layers / decoder_sparse_step say) and qwen3_moe (Qwen3 attention,
  no shared expert): every expert's parameters,
  gradients and optimizer state; activations of the routed experts only (top-k per token), as
  transformers' default experts implementation (grouped_mm) saves them;
- multi-head latent attention (MLA) with DeepSeek's mixture of experts: deepseek_v2 and
  deepseek_v3. q from q_proj, or through the q_lora_rank bottleneck (q_a_proj, its RMSNorm,
  q_b_proj); k and v from one latent (kv_a_proj_with_mqa to kv_lora_rank + the shared rotary
  part, its RMSNorm, kv_b_proj to every head's nope part and v); q/k heads of qk_nope_head_dim +
  qk_rope_head_dim, v heads of v_head_dim (so sdpa cannot run flash in 16 bits unless they are
  equal: the memory-efficient kernel); the first first_k_dense_replace layers dense, the rest
  n_routed_experts routed (top num_experts_per_tok) + n_shared_experts shared experts in one MLP,
  routed by an fp32 gate (V2: softmax, greedy or group-limited; V3: sigmoid + the
  e_score_correction_bias buffer, group-limited, renormalised);
- "gpt2": LayerNorm, learned positions, GELU MLP, fused qkv projection (approximate: dropout
  masks and the GELU form; --measure counts it exactly).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, asdict
from pathlib import Path

from .schema import SchemaError, validate_config  # noqa: F401  (SchemaError: for callers)

LLAMA_TYPES = ("llama", "qwen2", "mistral", "granite", "qwen3")
MOE_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe")
MLA_TYPES = ("deepseek_v2", "deepseek_v3")  # multi-head latent attention + DeepSeek's mixture of experts
QK_NORM_TYPES = ("qwen3", "qwen3_moe")      # RMSNorm over head_dim on q and k before rotary
GPT2_TYPES = ("gpt2",)
KNOWN_TYPES = LLAMA_TYPES + MOE_TYPES + MLA_TYPES + GPT2_TYPES
# keys that say a config is a mixture of experts (Mixtral, Qwen-MoE, DeepSeek, OLMoE, ...)
MOE_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_intermediate_size",
            "num_experts_per_tok", "moe_num_experts")
# sub-configs of a multimodal model (LLaVA, Mistral-3, Qwen2-VL, CLIP, Whisper's audio side...)
MULTIMODAL_KEYS = ("vision_config", "audio_config", "speech_config", "image_config", "vision_tower_config")
LINEAR_NAMES_LLAMA = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class ConfigError(ValueError):
    """A config that cannot be read or is not a supported architecture (one clear line)."""


class NotModelled(ConfigError):
    """A readable config of an architecture the analytical formula does not model: refused by the
    formula, measured by --measure (which builds it with transformers)."""


@dataclass
class Arch:
    family: str                 # "llama" | "mla" (DeepSeek-V2/V3: llama-like, attention apart) | "gpt2"
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
    sliding_window: int | None = None   # the window of the sliding-window layers
    sliding_layers: int = 0             # how many layers use it
    # mixture of experts (0 experts: dense)
    experts: int = 0                    # E experts per MoE layer
    top_k: int = 0                      # experts per token
    expert_intermediate: int = 0        # each expert's intermediate size
    shared_intermediate: int = 0        # qwen2_moe's shared expert (0: none)
    moe_layers: int = 0                 # layers with an MoE block (the rest have the dense MLP)
    norm_topk: bool = False             # routing weights renormalised over the top k
    router_fp32_weights: bool = False   # routing weights stay fp32 (mixtral) or are cast to the model dtype
    router_last: bool = False           # qwen3_moe registers the experts before the router
    shared_gate: bool = False           # qwen2_moe: a sigmoid gate (1 x h) on the shared expert's output
    # how the router picks the top k: "softmax" (mixtral, qwen: in the model's dtype); DeepSeek's fp32
    # gate: "greedy" / "group_limited_greedy" (V2, softmax scores), "noaux_tc" (V3, sigmoid scores
    # + a bias buffer, the best router_topk_groups of router_groups groups)
    router: str = "softmax"
    router_groups: int = 1
    router_topk_groups: int = 1
    # multi-head latent attention (kv_lora_rank 0: none); head_dim is then qk_nope + qk_rope
    q_lora_rank: int = 0                # 0: q_proj straight from the hidden size
    kv_lora_rank: int = 0
    qk_nope_dim: int = 0
    qk_rope_dim: int = 0
    v_head_dim: int = 0
    qk_norm: bool = False               # qwen3: RMSNorm(head_dim) on q and k
    cross_attention: bool = False       # gpt2 add_cross_attention: a cross-attention block per layer
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
        return self.attn_linears() + self.mlp_linears()

    def attn_linears(self) -> list[tuple[str, int, int, bool]]:
        """The attention's Linear modules, in registration order (not gpt2)."""
        h, kv = self.hidden, self.kv_heads * self.head_dim
        q = self.heads * self.head_dim
        if self.family == "mla":
            H, r = self.heads, self.q_lora_rank
            qs = ([("q_a_proj", h, r, self.qkv_bias), ("q_b_proj", r, q, False)] if r
                  else [("q_proj", h, q, False)])
            return qs + [("kv_a_proj_with_mqa", h, self.kv_lora_rank + self.qk_rope_dim, self.qkv_bias),
                         ("kv_b_proj", self.kv_lora_rank, H * (self.qk_nope_dim + self.v_head_dim), False),
                         ("o_proj", H * self.v_head_dim, h, self.o_bias)]
        return [("q_proj", h, q, self.qkv_bias), ("k_proj", h, kv, self.qkv_bias),
                ("v_proj", h, kv, self.qkv_bias), ("o_proj", q, h, self.o_bias)]

    def mlp_linears(self) -> list[tuple[str, int, int, bool]]:
        """The dense MLP's Linear modules (not gpt2)."""
        h, i = self.hidden, self.intermediate
        out = []
        if self.gated_mlp:
            out += [("gate_proj", h, i, self.mlp_bias), ("up_proj", h, i, self.mlp_bias)]
        else:
            out += [("up_proj", h, i, self.mlp_bias)]
        out.append(("down_proj", i, h, self.mlp_bias))
        return out

    def norm_params(self) -> int:
        """Parameters of one norm (RMSNorm: weight; LayerNorm: weight + bias)."""
        return self.hidden * (2 if self.family == "gpt2" else 1)

    def moe_param_shapes(self) -> list[tuple[int, ...]]:
        """Shapes of one MoE block's parameters: the router, the experts' 3-D gate_up and down
        tensors (one tensor each, all experts), and the shared expert (with qwen2_moe's 1-wide gate)."""
        h, E, I, Is = self.hidden, self.experts, self.expert_intermediate, self.shared_intermediate
        shapes = [(E, h), (E, 2 * I, h), (E, h, I)]
        if Is:
            b = self.mlp_bias and self.family == "mla"     # DeepseekV2MLP takes mlp_bias
            for sh in ((Is, h), (Is, h), (h, Is)):
                shapes += [sh] + ([sh[:1]] if b else [])
            shapes += [(1, h)] if self.shared_gate else []
        return shapes

    def attn_param_shapes(self) -> list[tuple[int, ...]]:
        """The attention's parameters in registration order (MLA: its RMSNorms on the q and kv latents)."""
        out: list[tuple[int, ...]] = []
        for name, a, b, bias in self.attn_linears():
            out += [(b, a)] + ([(b,)] if bias else [])
            if self.family == "mla" and name == "q_a_proj":
                out.append((self.q_lora_rank,))            # q_a_layernorm
            if self.family == "mla" and name == "kv_a_proj_with_mqa":
                out.append((self.kv_lora_rank,))           # kv_a_layernorm
        if self.qk_norm:
            out += [(self.head_dim,), (self.head_dim,)]
        return out

    def _block_params(self, moe: bool) -> int:
        if self.family == "gpt2":
            lin = sum(a * b + (b if bias else 0) for _, a, b, bias in self.linears())
        else:
            lin = sum(_prod(sh) for sh in self.attn_param_shapes())
            if not moe:
                lin += sum(a * b + (b if bias else 0) for _, a, b, bias in self.mlp_linears())
        if moe:
            for shape in self.moe_param_shapes():
                n = 1
                for d in shape:
                    n *= d
                lin += n
        return lin + self.cross_attention_params() + 2 * self.norm_params()

    def cross_attention_params(self) -> int:
        """One layer's cross-attention parameters (GPT-2's add_cross_attention): q_attn (h, h),
        c_attn (h, 2h), c_proj (h, h), all biased, and ln_cross_attn."""
        if not self.cross_attention:
            return 0
        h = self.hidden
        return 4 * h * h + 4 * h + self.norm_params()

    def idle_params(self) -> int:
        """Parameters a causal-LM training step never runs, so they get no gradient and torch.optim
        keeps no state for them (it skips a parameter whose .grad is None): GPT-2's cross-attention
        blocks, which run only when encoder_hidden_states is passed (checked on a CPU step:
        p.grad is None and no AdamW state for every crossattention / ln_cross_attn tensor)."""
        return self.layers * self.cross_attention_params()

    def layer_trained_params(self) -> int:
        """Parameters of the largest layer that get a gradient in a step."""
        return self.layer_params() - self.cross_attention_params()

    def layer_params(self) -> int:
        """Parameters of the largest layer (an MoE layer when there is one)."""
        return self._block_params(moe=bool(self.experts and self.moe_layers))

    def all_layer_params(self) -> int:
        """Parameters of all layers (MoE and dense layers mixed as the config says)."""
        if not self.experts:
            return self.layers * self._block_params(False)
        return (self.moe_layers * self._block_params(True)
                + (self.layers - self.moe_layers) * self._block_params(False))

    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    def position_params(self) -> int:
        return self.max_positions * self.hidden if self.family == "gpt2" else 0

    def head_params(self) -> int:
        """lm_head weight when not tied to the embedding (tied weights are one tensor, counted once)."""
        return 0 if self.tie_embeddings else self.vocab * self.hidden

    def param_count(self) -> int:
        return (self.embedding_params() + self.position_params() + self.all_layer_params()
                + self.norm_params() + self.head_params())

    def linear_weight_params(self, include_head: bool = True) -> int:
        """Weights that autocast casts to low precision (Linear weights; the embedding is not cast)."""
        n = self.layers * sum(a * b for _, a, b, _ in self.linears())
        return n + (self.vocab * self.hidden if include_head else 0)

    def largest_param(self) -> int:
        """Elements of the largest single parameter tensor (the for-loop optimizers' temporaries scale with it)."""
        biggest_linear = max(a * b for _, a, b, _ in self.linears())
        if self.experts:
            biggest_linear = max([biggest_linear] + [_prod(sh) for sh in self.moe_param_shapes()])
        return max(self.embedding_params(), biggest_linear, self.position_params())

    def param_shapes(self, trained_only: bool = False) -> list[tuple[int, ...]]:
        """The shape of every parameter tensor in model.parameters() order (transformers' module
        order; a tied output head is the embedding, listed once). Optimizer state that depends
        on shapes (Adafactor's factored rows and columns, 8-bit Adam's blocks and its small
        tensors kept in 32 bits) is computed from these. trained_only: without the ones a step
        never runs (idle_params)."""
        h, V = self.hidden, self.vocab
        if self.family == "gpt2":
            i = self.intermediate
            block = [(h,), (h,), (h, 3 * h), (3 * h,), (h, h), (h,), (h,), (h,)]     # ln_1, c_attn, c_proj, ln_2
            if self.cross_attention and not trained_only:   # crossattention: c_attn (h, 2h), q_attn, c_proj; ln_cross_attn
                block += [(h, 2 * h), (2 * h,), (h, h), (h,), (h, h), (h,), (h,), (h,)]
            block += [(h, i), (i,), (i, h), (h,)]                                   # mlp c_fc, c_proj
            out = [(V, h), (self.max_positions, h)] + block * self.layers + [(h,), (h,)]
            return out + ([] if self.tie_embeddings else [(V, h)])
        out = [(V, h)]
        attn = self.attn_param_shapes()
        dense: list[tuple[int, ...]] = []
        for _, a, b, bias in self.mlp_linears():
            dense += [(b, a)] + ([(b,)] if bias else [])
        moe = list(self.moe_param_shapes()) if self.experts else []
        if self.router_last and moe:
            moe = moe[1:3] + moe[:1] + moe[3:]
        for i in range(self.layers):
            out += attn + (moe if self._is_moe_layer(i) else dense) + [(h,), (h,)]
        out.append((h,))
        if not self.tie_embeddings:
            out.append((V, h))
        return out

    def param_numels(self, trained_only: bool = False) -> list[int] | None:
        """Elements of every parameter tensor in model.parameters() order."""
        return [_prod(sh) for sh in self.param_shapes(trained_only)]

    def _is_moe_layer(self, i: int) -> bool:
        if not self.experts:
            return False
        if self.moe_layers == self.layers:
            return True
        return i in self.extra.get("moe_layer_ids", ())

    def factored_elems(self) -> int:
        """torch.optim.Adafactor's state elements: for a tensor of >= 2 dims a row variance
        (shape[:-1]) and a column variance (shape[:-2] + shape[-1:]); a full variance for vectors."""
        return factored_elems(self.param_shapes(trained_only=True))

    def masked_layers(self, seq: int) -> int:
        """Layers whose attention gets an explicit mask at this length: Hugging Face skips the
        sliding-window mask only while the sequence is shorter than the window
        (masking_utils._ignore_causal_mask_sdpa: kv_length < local_attention_size)."""
        if self.sliding_window is None or seq < self.sliding_window:
            return 0
        return self.sliding_layers

    def lora_params(self, rank: int, targets: tuple[str, ...]) -> int:
        """Trainable parameters of LoRA adapters of rank r on the named linears of every layer."""
        if self.experts:
            raise ConfigError(f"LoRA on a mixture-of-experts model ({self.model_type}) is not modelled by the "
                              "analytical formula (frozen experts save other tensors); drop --lora-rank")
        if self.family == "mla":
            raise ConfigError(f"LoRA on multi-head latent attention ({self.model_type}) is not modelled by the "
                              "analytical formula (a frozen base saves other tensors); drop --lora-rank")
        names = [name for name, *_ in self.linears()]
        unmatched = [t for t in targets if t != "all" and not any(n == t or n.endswith("." + t) for n in names)]
        if unmatched:
            raise ConfigError(f"--lora-targets {','.join(unmatched)} match(es) no Linear of a {self.model_type} layer "
                              f"(its Linears: {', '.join(names)}, or all)")
        n = 0
        for name, a, b, _ in self.linears():
            if any(name == t or name.endswith("." + t) or t == "all" for t in targets):
                n += rank * (a + b)
        return n * self.layers

    def to_dict(self) -> dict:
        d = asdict(self)
        d["param_count"] = self.param_count()
        return d


def factored_elems(shapes) -> int:
    """Adafactor's state elements for these parameter shapes (torch/optim/_adafactor.py: row_var
    shape[:-1], col_var shape[:-2] + shape[-1:] for >= 2 dims; variance of the full shape for vectors)."""
    n = 0
    for sh in shapes:
        if len(sh) >= 2:
            n += _prod(sh[:-1]) + _prod(sh[:-2]) * sh[-1]
        else:
            n += _prod(sh)
    return n


def _prod(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _get(cfg: dict, *names, default=None):
    for n in names:
        if cfg.get(n) is not None:
            return cfg[n]
    return default


def multimodal_parts(cfg: dict) -> list[str]:
    """The sub-configs that make a config more than a language model (a vision tower, an audio
    encoder), or [] for a text model."""
    return [k for k in MULTIMODAL_KEYS if isinstance(cfg.get(k), dict)]


def multimodal_refusal(cfg: dict, source: str = "") -> str | None:
    """One line for a multimodal config (LLaVA, Mistral-3, CLIP, ...), the same in both modes: its
    vision tower and projector are not modelled, and an estimate of the text model alone would be
    silently low (issue 34: LLaVA and Mistral-3 were estimated as their text model, no note)."""
    parts = multimodal_parts(cfg)
    if not parts:
        return None
    where = f"{source}: " if source else ""
    mt = str(cfg.get("model_type", "") or "?")
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else None
    tmt = str((text or {}).get("model_type", "") or "")
    towers = " and ".join(p.replace("_config", "") for p in parts if p != "text_config") or "non-text"
    hint = (f"; to estimate its language model alone, save text_config as a config of its own"
            f"{' (model_type ' + repr(tmt) + ')' if tmt else ''} and add the {towers} part's memory yourself"
            if text is not None else "")
    return (f"{where}{mt} is a multimodal model ({', '.join(parts)}): its {towers} tower and projector are "
            f"not modelled by gpumon estimate (neither the formula nor --measure){hint}")


def arch_from_config(cfg: dict, source: str = "") -> Arch:
    """Build an Arch from a config dict as found in a Hugging Face config.json."""
    where = f"{source}: " if source else ""
    mm = multimodal_refusal(cfg, source)
    if mm:
        raise NotModelled(mm)
    if "text_config" in cfg and "hidden_size" not in cfg:   # a wrapper of a language model alone
        cfg = {**cfg["text_config"], "tie_word_embeddings": cfg.get("tie_word_embeddings",
                                                                    cfg["text_config"].get("tie_word_embeddings"))}
    mt = str(cfg.get("model_type", "")).lower()
    if cfg.get("kv_lora_rank") and mt not in MLA_TYPES:
        raise NotModelled(f"{where}{mt or 'this model'} uses multi-head latent attention (kv_lora_rank="
                          f"{cfg['kv_lora_rank']}) in a model type the analytical formula does not know (it models "
                          f"MLA as {' and '.join(MLA_TYPES)} build it); use --measure")
    if not mt:
        raise NotModelled(f"{where}no model_type: cannot tell the architecture (the analytical formula knows "
                          f"{', '.join(KNOWN_TYPES)}; --measure with --model builds anything)")
    moe = [k for k in MOE_KEYS if cfg.get(k)]
    if moe and mt not in MOE_TYPES + MLA_TYPES:
        raise NotModelled(f"{where}{mt} is a mixture-of-experts model ({moe[0]}={cfg[moe[0]]}) the analytical "
                          f"formula does not know (it knows {', '.join(KNOWN_TYPES)}); use --measure")
    if mt not in KNOWN_TYPES:
        raise NotModelled(f"{where}model_type {mt!r} is not one the analytical formula knows "
                          f"({', '.join(KNOWN_TYPES)}); use --measure, which builds it with transformers")
    try:
        if mt in MLA_TYPES:
            return _mla_arch(cfg, mt, source)
        if mt in GPT2_TYPES:
            h = int(cfg["n_embd"])
            heads = int(cfg["n_head"])
            return Arch(family="gpt2", model_type=mt or "gpt2", hidden=h,
                        intermediate=int(cfg.get("n_inner") or 4 * h), layers=int(cfg["n_layer"]),
                        heads=heads, kv_heads=heads, head_dim=h // heads, vocab=int(cfg["vocab_size"]),
                        max_positions=int(_get(cfg, "n_positions", "n_ctx", default=1024)),
                        tie_embeddings=bool(cfg.get("tie_word_embeddings", True)),
                        qkv_bias=True, o_bias=True, mlp_bias=True, gated_mlp=False, source=source,
                        # GPT2Block adds a cross-attention (q_attn, c_attn to 2h, c_proj, its LayerNorm)
                        # with add_cross_attention: parameters only (it runs with encoder states alone,
                        # so a language-model step leaves them without gradient or optimizer state)
                        cross_attention=bool(cfg.get("add_cross_attention", False)),
                        extra={"activation": cfg.get("activation_function", "gelu_new"),
                               "dropout": float(_get(cfg, "resid_pdrop", default=0.1)),
                               "attn_dropout": float(_get(cfg, "attn_pdrop", default=0.1)),
                               **_run_defaults(cfg)})
        h = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        kv = int(_get(cfg, "num_key_value_heads", default=heads))
        head_dim = int(_get(cfg, "head_dim", default=128 if mt == "qwen3" else h // heads))
        qkv_bias = bool(cfg.get("attention_bias", mt == "qwen2"))
        layers = int(cfg["num_hidden_layers"])
        window, n_sliding = _sliding(cfg, mt, layers)
        moe = _moe(cfg, mt, layers) if mt in MOE_TYPES else {}
        moe_ids = moe.pop("_moe_layer_ids", None)
        if mt == "qwen2_moe":
            qkv_bias = bool(cfg.get("qkv_bias", True))    # Qwen2MoeAttention: o_proj never has one
        if mt in QK_NORM_TYPES:
            qkv_bias = bool(cfg.get("attention_bias", False))    # Qwen3Attention: o_proj too
        return Arch(family="llama", model_type=mt or "llama", hidden=h,
                    intermediate=int(_get(cfg, "intermediate_size", default=0) or 0), layers=layers,
                    heads=heads, kv_heads=kv, head_dim=head_dim, vocab=int(cfg["vocab_size"]),
                    max_positions=int(_get(cfg, "max_position_embeddings", default=2048)),
                    tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                    qkv_bias=qkv_bias, o_bias=bool(cfg.get("attention_bias", False)) and mt != "qwen2",
                    qk_norm=mt in QK_NORM_TYPES,
                    mlp_bias=bool(cfg.get("mlp_bias", False)), gated_mlp=True, source=source,
                    sliding_window=window, sliding_layers=n_sliding, **moe,
                    extra={"activation": cfg.get("hidden_act", "silu"),
                           "attn_dropout": float(cfg.get("attention_dropout") or 0.0),
                           **_run_defaults(cfg),
                           **({"moe_layer_ids": moe_ids} if moe_ids is not None else {})})
    except KeyError as e:
        raise NotModelled(f"config {source or ''} lacks {e.args[0]!r}: not a decoder transformer "
                          f"config this estimator understands ({', '.join(KNOWN_TYPES)}); use --measure") from None
    except (TypeError, ValueError) as e:
        raise ConfigError(f"config {source or ''}: bad value ({e})") from None


def _mla_arch(cfg: dict, mt: str, source: str) -> Arch:
    """DeepSeek-V2/V3 as transformers 5.x builds them (DeepseekV2Config/DeepseekV3Config defaults
    for the keys a config leaves out; a null q_lora_rank, as V2-Lite has, is q_proj straight from
    the hidden size)."""
    v3 = mt == "deepseek_v3"
    where = f"{source}: " if source else ""
    h = int(cfg["hidden_size"])
    heads = int(cfg["num_attention_heads"])
    layers = int(cfg["num_hidden_layers"])
    q_lora = cfg.get("q_lora_rank", 1536)
    nope = int(_get(cfg, "qk_nope_head_dim", default=128))
    rope = int(_get(cfg, "qk_rope_head_dim", default=64))
    v = int(_get(cfg, "v_head_dim", default=128))
    E = int(_get(cfg, "n_routed_experts", default=256 if v3 else 64))
    k = cfg.get("num_experts_per_tok", 8 if v3 else None)
    if k is None:
        raise NotModelled(f"{where}{mt} without num_experts_per_tok: transformers' {mt} cannot route (no top k)")
    k = int(k)
    n_shared = int(_get(cfg, "n_shared_experts", default=1 if v3 else 2))
    moe_i = int(_get(cfg, "moe_intermediate_size", default=2048 if v3 else 1407))
    first_dense = int(_get(cfg, "first_k_dense_replace", default=3 if v3 else 0))
    method = "noaux_tc" if v3 else str(_get(cfg, "topk_method", default="greedy"))
    if method not in ("greedy", "group_limited_greedy", "noaux_tc"):
        raise NotModelled(f"{where}{mt} with topk_method {method!r} is not modelled by the analytical formula; "
                          "use --measure")
    if method == "noaux_tc" and not v3:
        raise NotModelled(f"{where}deepseek_v2 with topk_method 'noaux_tc': transformers' DeepseekV2 router has no "
                          "such method (it is DeepSeek-V3's: model_type deepseek_v3)")
    groups, topk_groups = 1, 1
    if method != "greedy":
        groups = int(_get(cfg, "n_group", default=8 if v3 else 0) or 0)
        topk_groups = int(_get(cfg, "topk_group", default=4 if v3 else 0) or 0)
        if groups < 1 or topk_groups < 1 or E % groups or topk_groups > groups:
            raise ConfigError(f"{where}{mt}: {method} routing needs n_group dividing n_routed_experts ({E}) and "
                              f"1 <= topk_group <= n_group (n_group={groups}, topk_group={topk_groups})")
        if k > topk_groups * (E // groups):
            raise ConfigError(f"{where}{mt}: num_experts_per_tok {k} is more than the {topk_groups} chosen groups "
                              f"hold ({topk_groups} x {E // groups} experts)")
    elif k > E:
        raise ConfigError(f"{where}{mt}: num_experts_per_tok {k} is more than n_routed_experts {E}")
    if str(cfg.get("hidden_act", "silu")) != "silu":
        raise NotModelled(f"{where}{mt} with hidden_act {cfg.get('hidden_act')!r} is not modelled by the analytical "
                          "formula (SiLU only); use --measure")
    ids = tuple(i for i in range(layers) if i >= first_dense) if E > 0 else ()
    bias = bool(cfg.get("attention_bias", False))
    return Arch(family="mla", model_type=mt, hidden=h,
                intermediate=int(_get(cfg, "intermediate_size", default=18432 if v3 else 11008)), layers=layers,
                heads=heads, kv_heads=heads, head_dim=nope + rope, vocab=int(_get(cfg, "vocab_size",
                                                                                default=129280 if v3 else 102400)),
                max_positions=int(_get(cfg, "max_position_embeddings", default=4096 if v3 else 2048)),
                tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                qkv_bias=bias, o_bias=bias, mlp_bias=bool(cfg.get("mlp_bias", False)) and not v3,
                gated_mlp=True, source=source,
                experts=E if ids else 0, top_k=k if ids else 0, expert_intermediate=moe_i if ids else 0,
                shared_intermediate=moe_i * n_shared if ids else 0, moe_layers=len(ids),
                norm_topk=bool(cfg.get("norm_topk_prob", True)) if v3 else False,
                router_fp32_weights=True, router_last=True, router=method if ids else "softmax",
                router_groups=groups, router_topk_groups=topk_groups,
                q_lora_rank=int(q_lora) if q_lora else 0, kv_lora_rank=int(_get(cfg, "kv_lora_rank", default=512)),
                qk_nope_dim=nope, qk_rope_dim=rope, v_head_dim=v,
                extra={"activation": "silu", "attn_dropout": float(cfg.get("attention_dropout") or 0.0),
                       **_run_defaults(cfg), **({"moe_layer_ids": ids} if ids else {})})


def _run_defaults(cfg: dict) -> dict:
    """What the config says about the run: its dtype (transformers 5 writes `dtype`, 4.x
    `torch_dtype`) and its attention implementation, which the estimate takes as defaults."""
    out = {}
    dt = cfg.get("dtype") or cfg.get("torch_dtype")
    if isinstance(dt, str):
        out["config_dtype"] = dt
    impl = cfg.get("attn_implementation") or cfg.get("_attn_implementation")
    if isinstance(impl, str):
        out["attn_implementation"] = impl
    return out


def _moe(cfg: dict, mt: str, layers: int) -> dict:
    """Mixture-of-experts fields as transformers 5.x builds mixtral and qwen2_moe."""
    if mt == "mixtral":
        E = int(cfg.get("num_local_experts") or 8)
        k = int(cfg.get("num_experts_per_tok") or 2)
        if float(cfg.get("router_jitter_noise") or 0) > 0:
            raise NotModelled("mixtral with router_jitter_noise > 0 (an extra saved multiplier) is not modelled by "
                              "the analytical formula; use --measure")
        return dict(experts=E, top_k=k, expert_intermediate=int(cfg["intermediate_size"]), moe_layers=layers,
                    norm_topk=True, router_fp32_weights=True)
    # qwen2_moe, qwen3_moe: MoE in layer i when i not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0
    q3 = mt == "qwen3_moe"
    if q3 and cfg.get("use_sliding_window"):
        raise NotModelled("qwen3_moe with use_sliding_window is not modelled by the analytical formula; use --measure")
    E = int(cfg.get("num_experts") or (128 if q3 else 60))
    k = int(cfg.get("num_experts_per_tok") or (8 if q3 else 4))
    step = int(cfg.get("decoder_sparse_step") or 1)
    only = set(cfg.get("mlp_only_layers") or [])
    ids = [i for i in range(layers) if i not in only and E > 0 and (i + 1) % step == 0]
    n_moe = len(ids)
    return dict(_moe_layer_ids=tuple(ids), experts=E, top_k=k,
                expert_intermediate=int(cfg.get("moe_intermediate_size") or (768 if q3 else 1408)),
                shared_intermediate=0 if q3 else int(_get(cfg, "shared_expert_intermediate_size", default=5632)),
                moe_layers=n_moe, norm_topk=bool(cfg.get("norm_topk_prob", False)), router_fp32_weights=False,
                router_last=q3, shared_gate=not q3)


def _sliding(cfg: dict, mt: str, layers: int) -> tuple[int | None, int]:
    """(window, number of sliding-window layers) as transformers 5.x decides them."""
    window = cfg.get("sliding_window")
    if not window:
        return None, 0
    types = cfg.get("layer_types")
    if isinstance(types, list) and types:
        return int(window), sum(1 for t in types[:layers] if t == "sliding_attention")
    if mt in ("mistral", "mixtral"):
        return int(window), layers
    if mt == "qwen2_moe":     # Qwen2MoeConfig.__post_init__: even layers below max_window_layers
        if not cfg.get("use_sliding_window"):
            return None, 0
        first = int(_get(cfg, "max_window_layers", default=28))
        return int(window), sum(1 for i in range(layers) if (i + 1) % 2 and i < first)
    if mt in ("qwen2", "qwen3"):      # Qwen2Config/Qwen3Config: sliding from layer max_window_layers on
        if not cfg.get("use_sliding_window"):
            return None, 0
        first = int(_get(cfg, "max_window_layers", default=28))
        return int(window), max(0, layers - first)
    return None, 0


def read_config(path: str | Path) -> tuple[dict, Path]:
    """config.json (a file, or a folder holding one) read as plain JSON: (the dict, the file)."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    try:
        cfg = json.loads(p.read_text())
    except FileNotFoundError:
        raise ConfigError(f"no such config file: {p}") from None
    except UnicodeDecodeError:  # a binary file (a checkpoint, a pickle) named by mistake
        raise ConfigError(f"{p} is not a config.json: not text (a model's config.json is JSON; "
                          "a checkpoint or pickle is not)") from None
    except OSError as e:
        raise ConfigError(f"cannot read {p}: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{p} is not valid JSON: {e}") from None
    except RecursionError:
        raise ConfigError(f"{p} is not a config: JSON nested too deeply") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"{p} is not a JSON object")
    return cfg, p


def load_config(path: str | Path) -> tuple[Arch, dict]:
    """Read config.json (a file, or a folder holding one) as plain JSON; the architecture from it
    (NotModelled: one the analytical formula does not model)."""
    cfg, p = read_config(path)
    validate_config(cfg, str(p))      # SchemaError: a number no model has (before any arithmetic)
    try:
        arch = arch_from_config(cfg, source=str(p))
    except ConfigError:
        raise
    except (ArithmeticError, AttributeError, TypeError, ValueError) as e:  # 1e999, 0 heads, ...
        raise ConfigError(f"config {p}: bad value ({type(e).__name__}: {e})") from None
    bad = [f"{k}={getattr(arch, k)}" for k in ("hidden", "intermediate", "layers", "heads",
                                                 "kv_heads", "head_dim", "vocab", "max_positions")
           if getattr(arch, k) < 1]
    if bad:
        raise ConfigError(f"config {p}: sizes must be at least 1 ({', '.join(bad)})")
    return arch, cfg
