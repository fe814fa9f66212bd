"""Activation memory: the blog's heuristic, and an analytical formula for decoder transformers.

The analytical formula counts, tensor by tensor, what autograd saves for backward in a Hugging
Face style decoder layer (the same tensors `--measure` sees through saved-tensor hooks), with the
dtype each tensor really has under each precision:

- fp32: everything 4 bytes.
- bf16/fp16 weights ("half"): 2 bytes, but RMSNorm upcasts its input to fp32 and saves that copy.
- autocast ("amp", fp32 master weights): the residual stream and the norms stay fp32; every Linear
  casts its input to 16 bits (one copy per consuming Linear, since autocast caches only weight
  casts) and its weight (one 16-bit copy per weight, kept until that layer's backward).

Autograd saves an input only when the gradient that needs it is required: a frozen Linear does not
save its input, `q * cos` saves only `cos`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .arch import Arch, _prod

BLOG_A_SLOPE = 4.6894e-4
BLOG_A_INTERCEPT = 1.8494e6
ATTN_CHOICES = ("sdpa", "flash", "efficient", "math", "eager")
LOSS_CHOICES = ("ce", "mean")


def blog_heuristic_bytes(n_params: int, batch: int, seq: int, act_bytes: int) -> int:
    """The blog's fit: A = 4.6894e-4 x N + 1.8494e6 activations per token; bytes = A x B x L x P.

    Labelled as a heuristic everywhere it is shown: it was fitted with module-output hooks, which
    miss what autograd saves inside modules, the logits and the L^2 attention scores.
    """
    a = BLOG_A_SLOPE * n_params + BLOG_A_INTERCEPT
    return int(a * batch * seq * act_bytes)


@dataclass
class ActivationModel:
    """What one forward leaves for backward, and the transients around it (bytes)."""
    method: str                    # "analytical" | "measured" | "heuristic"
    layers: int
    per_layer: int                 # saved per layer without checkpointing (incl. weight copies)
    per_layer_weight_copies: int   # autocast's 16-bit weight copies within per_layer
    per_layer_stored: int          # what stays per layer during forward (= per_layer, or the input with checkpointing)
    final: int                     # after the last layer: final norm, rotary tables
    head_saved: int                # saved at the head and loss (log_softmax output, lm_head weight copy)
    head_fwd_extra: int            # transient at the end of forward: logits (+ fp32 copy)
    head_bwd_pre: int              # live at the head in backward before lm_head's weight gradient exists (incl. head_saved)
    head_bwd_lm: int               # live at lm_head's backward, besides its weight gradient
    layer_bwd_transient: int       # gradient buffers inside one layer's backward
    attention: str = ""
    notes: list[str] = field(default_factory=list)
    # Layers that differ (DeepSeek's first dense layers before its MoE layers, qwen2_moe's
    # mlp_only_layers), first layer first; empty: every layer is per_layer / per_layer_stored /
    # layer_bwd_transient (which are then the averages)
    layer_saved: list[int] = field(default_factory=list)
    layer_transients: list[int] = field(default_factory=list)
    # bytes live at a layer's own forward high-water mark besides what the layers before it keep
    # (0: none above what the layer keeps): an MoE layer's routed output, two fp32 [S, h] tensors
    layer_fwd_peaks: list[int] = field(default_factory=list)

    @property
    def head_bwd_peak(self) -> int:
        return max(self.head_bwd_pre, self.head_bwd_lm)

    def layer_lists(self) -> tuple[list[int], list[int], list[int]]:
        """(saved while the layer runs backward, kept during forward, backward transient) of each layer."""
        n = self.layers
        live = self.layer_saved if len(self.layer_saved) == n else [self.per_layer] * n
        checkpointed = self.per_layer_stored != self.per_layer or not self.layer_saved
        stored = [self.per_layer_stored] * n if checkpointed else live
        trans = self.layer_transients if len(self.layer_transients) == n else [self.layer_bwd_transient] * n
        return live, stored, trans

    @property
    def stored_total(self) -> int:
        """Saved for backward at the end of forward."""
        return sum(self.layer_lists()[1]) + self.final + self.head_saved


def resolve_attention(attn: str, arch: Arch, compute_bytes: int, has_mask: bool = False, cuda: bool = True) -> str:
    """Which kernel `sdpa` dispatches to on a CUDA GPU (torch 2.x, sm80+).

    Flash needs fp16/bf16 and head_dim <= 256; the memory-efficient kernel takes fp32 but not
    grouped-query attention (enable_gqa), so fp32 GQA models (Qwen2.5) fall back to the math
    kernel, which materialises the B x H x L x L scores. A padding mask also forces math here.
    MLA (DeepSeek): q and k heads of qk_nope + qk_rope, v heads of v_head_dim, k and v expanded to
    every head: flash only where the three head dims are one (a multiple of 8, <= 256, as
    sdp_utils.cpp check_head_dim_size_flash wants). Else in 16 bits cuDNN's kernel: torch puts it
    first on sm90/sm100 with cuDNN > 9.15 (sdp_utils.cpp check_prefer_cudnn_attention; torch
    2.11+cu130 ships 9.19), and it takes q/k 192 with v 128 (DeepSeek-V2/V3): on an H100 its output
    came in q's layout, so HF's transpose().contiguous() copied it for o_proj (issue 34's estmla
    run: one [T, H x v_head_dim] per layer the memory-efficient kernel, which returns [B, L, H, D],
    does not make). fp32 (cuDNN takes 16 bits only): the memory-efficient kernel. --measure routes
    it the same. Dense models in 16 bits also get cuDNN there: it saves what flash saves.
    cuda False (--device cpu): no cuDNN.
    """
    if attn != "sdpa":
        return attn
    if has_mask:
        return "math"
    if arch.family == "mla":
        if compute_bytes == 2 and mla_flash_dims(arch):
            return "flash"
        return "cudnn" if compute_bytes == 2 and cuda else "efficient"
    if compute_bytes == 2 and arch.head_dim <= 256:
        return "flash"
    if arch.kv_heads != arch.heads:
        return "math"
    return "efficient"


def mla_flash_dims(arch: Arch) -> bool:
    """Whether CUDA's flash kernel takes this MLA model's heads: q, k and v of one head dim."""
    return arch.head_dim == arch.v_head_dim and arch.head_dim % 8 == 0 and arch.head_dim <= 256


def mla_attention_bytes(arch: Arch, batch: int, seq: int, precision: str, kernel: str,
                        dropout: bool) -> tuple[int, int, int]:
    """Multi-head latent attention (transformers' DeepseekV2Attention / DeepseekV3Attention), its
    input RMSNorm included: (bytes saved a token, bytes of B x H x L x L, bytes a layer besides).
    Tensor by tensor, as --measure's saved-tensor hooks see them (tests/estimate/test_mla.py):

    - each RMSNorm (the input's over h; q_a_layernorm over q_lora_rank; kv_a_layernorm over
      kv_lora_rank) saves its fp32 input (in 16 bits a copy; in fp32 kv_a_layernorm's input is a
      view of kv_a_proj_with_mqa's output, whose storage holds the rotary part too), its fp32 rsqrt
      (one value a token), x * rsqrt in the weights' dtype, and its output as the next Linear's input;
    - flash / efficient / cudnn: q (the cat of q_nope and the rotated q_pe) and k (every head: nope
      + the shared rotary part, a new tensor) of qk_nope + qk_rope; v, a view of kv_b_proj's output
      (so that whole output, nope parts included); the output, and its logsumexp (per layer).
      Efficient returns its output as [B, L, H, D], which o_proj reads in place; flash and cuDNN
      return q's layout ([B, H, L, D] here, q being a cat; cuDNN: MHA.cpp alloc_with_matching_layout),
      so HF's transpose().contiguous() copies it for o_proj;
    - math: sdpa upcasts 16-bit q, k, v to fp32 first, so q and k scaled (fp32), v's fp32 copy (in
      fp32 v as the matmul flattens it: below), the fp32 probabilities, o_proj's input copy;
    - eager: q, k, v as the matmul flattens it (batch 1: a view, so kv_b_proj's whole output;
      else a copy of v), the fp32 softmax and its 16-bit cast, o_proj's input.
    The rotary table (V2: complex64 freqs, V3: cos and sin) is one per step: counted with `final`.
    """
    h, H, d, vd = arch.hidden, arch.heads, arch.head_dim, arch.v_head_dim
    kvr, qr, rope, nope = arch.kv_lora_rank, arch.q_lora_rank, arch.qk_rope_dim, arch.qk_nope_dim
    pa = 4 if precision == "fp32" else 2

    def rms(dim: int, fp32_input: int) -> int:       # fp32 input, rsqrt, x * rsqrt, the output (a Linear's input)
        return fp32_input + 4 + 2 * pa * dim

    tok = rms(h, 4 * h)
    if qr:
        tok += rms(qr, 4 * qr)
    tok += rms(kvr, 4 * (kvr + rope) if pa == 4 else 4 * kvr)
    kv_b_out = H * (nope + vd) * pa
    B_H_L_L = batch * H * seq * seq
    if kernel in ("flash", "efficient", "cudnn"):
        q_layout = kernel in ("flash", "cudnn")       # the output in q's layout: o_proj's input is a copy
        tok += 2 * H * d * pa + kv_b_out + H * vd * pa + (H * vd * pa if q_layout else 0)
        # fp32 logsumexp: flash [B, H, L], cuDNN's softmax stats [B, H, L, 1], efficient L padded to 32
        lse = batch * H * (seq if q_layout else -(-seq // 32) * 32) * 4
        return tok, 0, lse
    # the probabilities' matmul with v (a view of kv_b_proj's output) flattens v to [B x H, L, v]:
    # a view for batch 1, a copy of v alone otherwise (v is strided over the nope parts)
    v_eager = kv_b_out if batch == 1 else H * vd * pa
    if kernel == "math":
        tok += 2 * H * d * 4 + (v_eager if pa == 4 else H * vd * 4) + H * vd * pa
        return tok, B_H_L_L * (4 + ((1 + 4) if dropout else 0)), 0
    tok += 2 * H * d * pa + v_eager + H * vd * pa      # eager
    return tok, B_H_L_L * (4 + ((1 + pa) if dropout else (pa if pa != 4 else 0))), 0


def mla_rotary_bytes(arch: Arch, seq: int, precision: str) -> int:
    """The rotary table the layers share ([1, L, ...], whatever the batch): DeepSeek-V2's complex64
    freqs_cis [L, qk_rope / 2] (8 bytes each); V3's cos and sin [L, qk_rope] in the model's dtype."""
    if arch.model_type == "deepseek_v2":
        return seq * arch.qk_rope_dim * 4
    return 2 * seq * arch.qk_rope_dim * (4 if precision == "fp32" else 2)


def transformer_activations(arch: Arch, batch: int, seq: int, precision: str, attn: str = "sdpa",
                            checkpointing: bool = False, loss: str = "ce",
                            trainable_linears: bool = True, lora_targets: tuple[str, ...] = (),
                            dropout: float | None = None, lora_rank: int = 0, cuda: bool = True) -> ActivationModel:
    """Analytical activation model of a decoder transformer.

    precision: "fp32" | "half" (bf16/fp16 weights) | "amp" (autocast to 16 bits, fp32 weights).
    trainable_linears False (frozen base, e.g. LoRA): Linear inputs are saved only for LoRA targets.
    cuda: the step runs CUDA's kernels (sdpa's choice of cuDNN, the softmax backward's temporary);
    False for a CPU run (--device cpu), whose kernels make neither.
    """
    if precision not in ("fp32", "half", "amp"):
        raise ValueError(precision)
    if loss not in LOSS_CHOICES:
        raise ValueError(f"unknown loss {loss!r}")
    T = batch * seq
    layer_saved: list[int] = []      # per layer, where they differ (MoE and dense layers)
    h, i, V = arch.hidden, arch.intermediate, arch.vocab
    qd = arch.heads * arch.head_dim
    kvd = arch.kv_heads * arch.head_dim
    res = 2 if precision == "half" else 4        # residual stream
    pa = 4 if precision == "fp32" else 2         # Linear outputs / attention / MLP
    kernel = resolve_attention(attn, arch, pa, cuda=cuda)
    label = kernel
    notes: list[str] = []

    def saves_input(name: str) -> bool:
        return trainable_linears or any(t == "all" or name == t or name.endswith("." + t) for t in lora_targets)

    # A frozen base (LoRA) freezes the norms' weights too: `weight * x_normed` then saves only the
    # weight (a parameter), not x_normed, so the middle term below goes.
    normed = 0 if not trainable_linears else 1

    def norm(n_consumers: int) -> int:
        """RMSNorm/LayerNorm saved bytes per token: its input, x*rsqrt, and its output as Linear input."""
        keep = normed
        if arch.family == "gpt2":       # LayerNorm saves input (+ mean/rstd); output saved by the Linear
            return res * h + (n_consumers and pa * h if precision != "amp" else 2 * h * n_consumers)
        if precision == "fp32":
            return 4 * h + keep * 4 * h + (4 * h if n_consumers else 0)
        if precision == "half":
            return 4 * h + keep * 2 * h + (2 * h if n_consumers else 0)
        return 4 * h + keep * 4 * h + 2 * h * n_consumers   # amp: one 16-bit cast per consuming Linear

    def n_saving(*names: str) -> int:
        return sum(1 for n in names if saves_input(n))

    BHLL = batch * arch.heads * seq * seq
    # fp32 logsumexp: flash [B, H, L] (flash_api.cpp mha_fwd); memory-efficient pads L to 32
    lse = batch * arch.heads * (seq if kernel == "flash" else -(-seq // 32) * 32) * 4
    # Attention dropout (attention_dropout / attn_pdrop), as CUDA runs it: flash and the
    # memory-efficient kernel draw it inside the kernel and keep a philox seed and offset (no mask);
    # the math kernel and eager attention run native_dropout, which saves a bool mask (1 byte an
    # element), and the matmul after it saves the dropped probabilities.
    p_attn = arch.extra.get("attn_dropout", 0.0) if dropout is None else dropout
    drop = p_attn > 0
    # sdpa's math kernel upcasts fp16/bf16 q, k, v to fp32 (attention.cpp, unless
    # torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(True)): its saved q, k, v and
    # probabilities are fp32 whatever the model's dtype (Llama-3.2-1B bf16 b2 s1024 was -13.3%)
    acc = 4 if kernel == "math" else pa
    if arch.family == "gpt2":
        p = arch.extra.get("dropout", 0.1)
        mask = h if p > 0 else 0                        # bool dropout masks, 1 byte
        per_tok = norm(n_saving("c_attn"))
        # qkv is one c_attn output: q, k, v are views of one [T, 3h] storage
        if kernel in ("flash", "efficient"):
            per_tok += 3 * h * pa + h * pa               # q k v + output (shared with c_proj input)
            attn_sq = 0
            extra = lse
        elif kernel == "math":   # fp32 copies of scaled q, k and of v; fp32 probabilities (+ mask, dropped)
            per_tok += 3 * h * acc + (h * pa if saves_input("attn.c_proj") else 0)
            attn_sq = BHLL * (acc + ((1 + acc) if drop else 0))
            extra = 0
        else:   # eager: softmax in the model's dtype, its dropout mask and the dropped probabilities
            per_tok += 3 * h * pa + (h * pa if saves_input("attn.c_proj") else 0)
            attn_sq = BHLL * (pa + ((pa + 1) if drop else 0))
            extra = 0
        per_tok += mask                                  # residual dropout after attention
        per_tok += norm(n_saving("c_fc"))
        act = arch.extra.get("activation", "gelu_new")
        # gelu_new is written in Python: x, tanh(...), 0.5*x, 1+tanh are saved (4 tensors of [T, i])
        per_tok += (4 if act in ("gelu_new", "gelu_pytorch_tanh_py") else 1) * i * pa
        per_tok += i * pa if saves_input("mlp.c_proj") else 0
        per_tok += mask
        per_layer = T * per_tok + attn_sq + extra
        notes.append("GPT-2 family: approximate (dropout masks, GELU form); prefer --measure")
    else:
        masked = arch.masked_layers(seq)
        if masked and attn == "flash":
            raise ValueError(f"--attn flash: the flash kernel takes no mask, and {arch.model_type}'s "
                             f"sliding-window layers pass one at sequence {seq} >= window {arch.sliding_window}")
        mla = arch.family == "mla"
        if mla:
            if precision == "amp":
                raise ValueError(f"autocast with multi-head latent attention ({arch.model_type}) is not modelled "
                                 "by the analytical formula")
            if not trainable_linears:
                raise ValueError(f"a frozen {arch.model_type} model (LoRA) is not modelled by the analytical formula")
            if kernel == "flash" and not mla_flash_dims(arch):
                raise ValueError(f"--attn flash: CUDA's flash kernel takes q, k and v of one head dim (a multiple of 8, "
                                 f"at most 256); {arch.model_type} has q/k {arch.head_dim}, v {arch.v_head_dim} (sdpa "
                                 "runs the memory-efficient kernel: --attn efficient)")
        per_tok = norm(n_saving("q_proj", "k_proj", "v_proj"))
        if arch.qk_norm:
            # RMSNorm(head_dim) on q and k (qwen3): each saves its fp32 input (the projection's
            # output, or its fp32 copy) and x * rsqrt (in the weights' dtype)
            xn = 4 if precision == "fp32" else 2
            per_tok += sum(4 * d + xn * d for d in (qd, kvd))
        base_tok = per_tok
        if mla:
            per_tok, attn_sq, extra = mla_attention_bytes(arch, batch, seq, precision, kernel, drop)
            notes.append(f"multi-head latent attention ({arch.model_type}): q/k heads of {arch.head_dim}, v heads of "
                         f"{arch.v_head_dim}" + ("" if mla_flash_dims(arch) else
                                                 " (unequal: sdpa runs cuDNN's kernel in 16 bits on sm90, the "
                                                   "memory-efficient one in fp32; not flash)")
                         + f", kv latent {arch.kv_lora_rank}" + (f", q latent {arch.q_lora_rank}" if arch.q_lora_rank
                                                                else ""))
        elif kernel in ("flash", "efficient"):
            # q_embed, k_embed (after rotary), v, and the output, which o_proj reads in place
            per_tok += (qd + 2 * kvd) * pa + qd * pa
            attn_sq, extra = 0, lse
        elif kernel == "math":
            # scaled q, scaled (repeated) k, repeated v and the softmax probabilities, all fp32 (the
            # upcast), with dropout its bool mask and the dropped probabilities; o_proj's input
            rep = arch.kv_heads != arch.heads
            per_tok += qd * acc + 2 * (qd if rep else kvd) * acc
            per_tok += qd * pa if saves_input("o_proj") else 0
            attn_sq, extra = BHLL * (acc + ((1 + acc) if drop else 0)), 0
        else:   # eager: q, repeated k and v, fp32 softmax (+ its cast, or with dropout the mask and
            # the dropped probabilities in the model's dtype), o_proj's contiguous input
            rep = arch.kv_heads != arch.heads
            per_tok += qd * pa + 2 * (qd if rep else kvd) * pa
            per_tok += qd * pa if saves_input("o_proj") else 0
            attn_sq = BHLL * (4 + ((1 + pa) if drop else (pa if pa != 4 else 0)))
            extra = 0
        if precision == "amp" and kernel in ("flash", "efficient"):
            pass  # rotary output is fp32 (fp32 cos/sin); sdpa's 16-bit casts are what is saved: same count
        mlp_tok = norm(n_saving("gate_proj", "up_proj"))
        # gate output (saved by SiLU), SiLU output and up output (saved by the product), product (down_proj input)
        mlp_tok += 3 * i * pa + (i * pa if saves_input("down_proj") else 0)
        mlp_tok += 4 if mla else 0      # the norm's fp32 rsqrt (counted for MLA, whose every term is)
        per_tok += mlp_tok
        per_layer = T * per_tok + attn_sq + extra
        if arch.experts:
            if precision == "amp":
                raise ValueError(f"autocast with a mixture-of-experts model ({arch.model_type}) is not modelled: "
                                 "transformers runs the experts' grouped_mm outside autocast")
            if not trainable_linears:
                raise ValueError("a frozen mixture-of-experts model (LoRA) is not modelled")
            moe_tok = _moe_tokens(arch, pa, norm(1) + (4 if mla else 0))
            moe_layer = T * (per_tok - mlp_tok + moe_tok) + attn_sq + extra + arch.experts * 4   # + offsets
            dense = arch.layers - arch.moe_layers
            if dense:
                layer_saved = [moe_layer if arch._is_moe_layer(j) else per_layer for j in range(arch.layers)]
            per_layer = (arch.moe_layers * moe_layer + dense * per_layer) // arch.layers
            notes.append(f"mixture of experts: {arch.top_k} of {arch.experts} experts per token in "
                         f"{arch.moe_layers} of {arch.layers} layers, activations as transformers' grouped_mm "
                         "experts save them (its default experts implementation)")
        if masked and attn in ("sdpa", "efficient"):
            # Sliding-window layers at seq >= window: HF passes a boolean mask, so it repeats k and v
            # itself (no enable_gqa) and CUDA's sdpa runs the memory-efficient kernel (flash takes no
            # mask). Saved: q, the repeated k and v, the output, the logsumexp, and the mask converted
            # to a bias of q's dtype, last dimension padded to 16, one per layer.
            sw_tok = base_tok + 3 * qd * pa + qd * pa + (mlp_tok if not arch.experts else
                                                          _moe_tokens(arch, pa, norm(1)))
            bias = batch * seq * (-(-seq // 16) * 16) * pa
            sw_layer = T * sw_tok + batch * arch.heads * (-(-seq // 32) * 32) * 4 + bias   # efficient's lse
            total = (arch.layers - masked) * per_layer + masked * sw_layer
            per_layer = total // arch.layers
            layer_saved = []        # averaged with the sliding-window layers
            label = "efficient with the sliding-window mask" if masked == arch.layers else \
                f"{kernel}; efficient with the sliding-window mask in {masked} of {arch.layers} layers"
            notes.append(f"sliding-window attention (window {arch.sliding_window} <= sequence {seq}): "
                         "the masked layers run sdpa's memory-efficient (or, in bf16 on sm90, cuDNN's) "
                         "kernel, saving the mask as a bias (the same rule --measure applies; on an H100 "
                         "both within 0.01% of the requested peak)")
    if lora_rank:
        # each adapter: lora_B saves lora_A's output (T x r); lora_A's input is the Linear's input above
        per_layer += T * lora_rank * pa * sum(1 for name, *_ in arch.linears() if saves_input(name))
    copies = 2 * sum(a * b for _, a, b, _ in arch.linears()) if precision == "amp" else 0
    per_layer += copies
    # last norm + lm_head input; rotary cos/sin (one pair shared by all layers)
    final = T * norm(1 if saves_input("lm_head") else 0)
    if not trainable_linears and not checkpointing and arch.family != "gpt2":
        # frozen embedding: the first layer's input needs no gradient, so its first norm saves
        # nothing, and with k frozen (k_proj no adapter) q @ k^T needs only k: q is not saved.
        # Counted here, once, rather than in every layer.
        first_less = 4 * h + (qd * pa if not saves_input("k_proj") and kernel in ("math", "eager") else 0)
        final -= T * first_less
    if arch.family == "mla":
        final += mla_rotary_bytes(arch, seq, precision) + 4 * T     # + the final norm's rsqrt
    elif arch.family != "gpt2":
        final += 2 * T * arch.head_dim * (2 if precision == "half" else 4)
    pl = 4 if precision == "fp32" else 2            # logits dtype
    TV = T * V
    head_copy = 2 * V * h if precision == "amp" else 0   # autocast's 16-bit lm_head weight
    if loss == "ce":
        head_saved = 4 * TV + head_copy                          # log_softmax output (fp32)
        head_fwd_extra = TV * pl + (4 * TV if pl != 4 else 0)   # logits, and HF's logits.float()
        head_pre = max(12 * TV,                                  # lsm out + nll grad + lsm grad
                       (4 + pl) * TV if pl != 4 else 0) + head_copy   # cast back to the logits dtype
        head_lm = pl * TV + T * h * pl + head_copy               # lm_head backward (weight grad counted apart)
    else:
        head_saved = head_copy
        head_fwd_extra = TV * pl
        head_pre = pl * TV + head_copy                           # mean's gradient, expanded
        head_lm = pl * TV + T * h * pl + head_copy
    stored = T * h * res if checkpointing else per_layer
    if checkpointing:
        notes.append("gradient checkpointing: each layer keeps only its input; one layer is recomputed at a time in backward")
    transient = 2 * T * i * pa
    if arch.family != "gpt2" and kernel in ("math", "eager") and not arch.experts:
        # The attention's own backward, after the MLP's (whose saved tensors are freed by then and
        # whose weight gradients exist): the B x H x L x L gradients it makes next to the saved
        # probabilities (issue 34: eager bf16 at seq 4096 was -2.9%).
        mlp_saved = T * mlp_tok if trainable_linears else 0
        mlp_grads = sum(a * b for name, a, b, _ in arch.linears() if name in ("gate_proj", "up_proj", "down_proj",
                                                                              "o_proj")) * (2 if precision == "half" else 4)
        attn_t = BHLL * attention_backward_transient(kernel, pa, drop, cuda) - mlp_saved + mlp_grads
        transient = max(transient, attn_t)
    transients: list[int] = []
    fwd_peaks: list[int] = []
    recompute: list[int] = []
    if arch.family == "mla" and arch.experts:
        # DeepSeek's MoE forward, at `weighted_out[inv_perm]` (transformers' grouped_mm experts):
        # the routed output scaled by the fp32 routing weights and its permuted copy, [S, h] fp32
        # each, the router's logits [T, E] fp32 (a local until the block returns), the layer's
        # saved tensors but the shared expert's (it runs after), and in 16 bits the residual
        # stream's tensors no norm saves: the embedding, the layer's input, its sum after attention
        moe_live = T * (per_tok - mlp_tok + moe_tok) + attn_sq + extra + arch.experts * 4
        moe_live -= T * 4 * arch.shared_intermediate * pa
        route = 2 * T * arch.top_k * h * 4 + T * arch.experts * 4
        rot = mla_rotary_bytes(arch, seq, precision)
        fwd_peaks = [moe_live + route + rot + (T * h * 2 * (3 if j else 2) if pa == 2 else 0)
                     if arch._is_moe_layer(j) else 0 for j in range(arch.layers)]
        if checkpointing:
            # no forward peak of that kind (nothing is saved in forward); the layer's recomputation in
            # backward has it instead, over the layer's kept input, with the incoming [T, h] gradient
            moe_full = T * (per_tok - mlp_tok + moe_tok) + attn_sq + extra + arch.experts * 4
            rec = moe_live + route + T * h * res + (T * h * 2 if pa == 2 else 0) + T * h * (2 if pa == 2 else 4)
            recompute = [rec - moe_full if arch._is_moe_layer(j) else 0 for j in range(arch.layers)]
            fwd_peaks = []
    elif arch.experts and not arch.shared_intermediate and not masked and not checkpointing:
        # Mixtral's and Qwen3-MoE's block (transformers' grouped_mm experts), at the same moment as
        # DeepSeek's, `weighted_out[inv_perm]` (--measure's traced forward, tensor by tensor): the
        # layer's saved tensors; the routed output scaled by the routing weights and its permuted
        # copy, [S, h] each in the weights' dtype (fp32 in mixtral); the block's locals: the router's
        # logits [T, E] (a Linear in the model's dtype, returned with the block's output), the top-k
        # routing weights [T, k] (the weights' dtype), the sorted expert ids [S] (int64), their 4-byte
        # copy for histc and its [E] counts; the step's position ids [L] (int64) and rotary cos and
        # sin ([1, L, head_dim] each: `final` counts them per token, but it is not part of this
        # moment); and in 16 bits the residual stream's tensors no norm saves: the embedding, the
        # layer's input, its sum after attention
        S = T * arch.top_k
        wb = 4 if arch.router_fp32_weights else pa
        E = arch.experts
        route = 2 * S * h * wb + T * E * pa + T * arch.top_k * wb + S * (8 + 4) + E * 4
        step = seq * 8 + 2 * seq * arch.head_dim * pa
        fwd_peaks = [moe_layer + route + step + (T * h * 2 * (3 if j else 2) if pa == 2 else 0)
                     if arch._is_moe_layer(j) else 0 for j in range(arch.layers)]
    # Checkpointed in 16 bits, the layer's input (kept by the checkpoint) is live through its
    # recomputation and backward apart from its saved tensors: the first RMSNorm saves an fp32 copy
    # of it (in fp32 the input itself); the recomputation's moment (rec) counts it already. The
    # H100's V2-Lite bf16 b16 checkpointed row needed it (issue 34's estmla run).
    kept_input = T * h * res if checkpointing and arch.family == "mla" and precision == "half" else 0
    if arch.family == "mla":
        # the attention's own backward, after the MLP's or the MoE block's (their saved tensors
        # freed, their weight gradients and o_proj's made). math / eager: the B x H x L x L
        # gradients, as for the dense decoders above. flash / efficient: the kernel's backward
        # makes q's, k's and v's gradients at once ([H x (qk_nope + qk_rope)] twice and
        # [H x v_head_dim] a token: MLA's heads are wide, more than the MLP's transient in V3)
        # while its incoming gradient and its saved tensors are alive, and the residual stream's
        # gradient waits
        gb = 2 if precision == "half" else 4
        Hd, Hv = arch.heads * arch.head_dim, arch.heads * arch.v_head_dim
        if kernel in ("math", "eager"):
            # at the softmax's backward o_proj's input and the v the probabilities' matmul saved are
            # freed, v's gradient made (math: fp32, as its saved copy), and the residual's waits
            v_saved = (Hv * 4 if pa != 4 else 0) if kernel == "math" else 0
            if not v_saved:
                v_saved = (arch.heads * (arch.qk_nope_dim + arch.v_head_dim) if batch == 1 else Hv) * (
                    4 if kernel == "math" else pa)
            v_grad = Hv * 4 if kernel == "math" else Hv * pa
            abt = BHLL * attention_backward_transient(kernel, pa, drop, cuda) + T * (h * gb + v_grad - v_saved - Hv * pa)
        else:
            abt = T * (2 * Hd + 2 * Hv) * pa + T * h * gb
        o_grad = Hv * h * gb
        dense_mlp = sum(a * b for _, a, b, _ in arch.mlp_linears())
        # the dense MLP's product backward: its two [T, i] gradients, down_proj's input gradient and
        # weight gradient made, the product it saved freed (the traced step; V3-shaped, fp32: -1.7% without)
        transient = 2 * T * i * pa + h * i * gb + T * h * gb      # + the incoming [T, h] gradient
        transient = max(transient, abt - T * mlp_tok + (dense_mlp * gb + o_grad)) + kept_input
        moe_attn_t = 0
        if arch.experts:
            E, I, Is = arch.experts, arch.expert_intermediate, arch.shared_intermediate
            moe_saved = T * _moe_tokens(arch, pa, norm(1) + 4) + E * 4
            moe_attn_t = abt - moe_saved + (3 * E * I * h + E * h + 3 * h * Is) * gb + o_grad
    if arch.experts:
        if arch.family == "mla":
            moe_t = max(deepseek_moe_backward_transient(arch, T, pa, checkpointing) + kept_input,
                        moe_attn_t + kept_input)
        else:
            moe_t = moe_backward_transient(arch, T, pa)
            if kernel in ("math", "eager"):
                gb = 2 if precision == "half" else 4
                moe_saved = T * _moe_tokens(arch, pa, norm(1)) + arch.experts * 4
                # the block's and o_proj's weight gradients, and the post-attention norm's
                moe_grads = sum(_prod(sh) for sh in arch.moe_param_shapes()) + h * qd + h
                moe_t = max(moe_t, BHLL * attention_backward_transient(kernel, pa, drop, cuda) - moe_saved
                            + moe_grads * gb + T * (h * gb - qd * pa))
        if layer_saved or recompute:
            transients = [moe_t if arch._is_moe_layer(j) else transient for j in range(arch.layers)]
            if recompute:
                transients = [max(t, r) for t, r in zip(transients, recompute)]
        transient = moe_t if arch.moe_layers == arch.layers else max(moe_t, transient)
    return ActivationModel(method="analytical", layers=arch.layers, per_layer=per_layer,
                           per_layer_weight_copies=copies, per_layer_stored=stored, final=final,
                           head_saved=head_saved, head_fwd_extra=head_fwd_extra, head_bwd_pre=head_pre, head_bwd_lm=head_lm,
                           layer_bwd_transient=transient, attention=label, notes=notes,
                           layer_saved=layer_saved, layer_transients=transients, layer_fwd_peaks=fwd_peaks)


def attention_backward_transient(kernel: str, pa: int, dropout: bool, cuda: bool = True) -> int:
    """Bytes per B x H x L x L element live above the saved ones while math or eager attention runs
    backward, the largest of its moments (each: what is still saved + the gradients alive then):

    - the probabilities' matmul: its saved input and the new gradient of it (pa; fp32 for math);
    - dropout's backward: the probabilities, the mask, the incoming and the outgoing gradient
      (the dropped probabilities are freed with the matmul's node);
    - eager's cast back (bf16/fp16 -> the fp32 softmax): the probabilities, a 16-bit and an fp32 gradient;
    - the softmax's backward: its fp32 output, the incoming and the new fp32 gradient: 12 bytes;
      on CUDA 16: softmax_backward_cuda_out makes `tmp = grad * output` (SoftMax.cu) before its
      kernel, a fourth fp32 B x H x L x L (issue 34's estmla run, DeepSeek-V2-Lite eager, bf16, b2
      s2048: its 512 MiB was the whole -6.0%; CPU's kernel makes none, so --measure's fake-tensor
      trace adds it too: measure._live_bytes_mode).
    sdpa's math kernel upcasts first, so it runs like eager in fp32 (pa = 4).
    Checked against --measure's traced steps (tests/estimate/test_attention_kernels.py).
    """
    if kernel == "math":
        pa = 4
    saved = 4 + ((1 + pa) if dropout else (pa if pa != 4 else 0))
    moments = [saved + pa, 16 if cuda else 12]
    if dropout:
        moments.append(4 + 1 + 2 * pa)
    if pa != 4:
        moments.append(8 + pa)
    return max(moments) - saved


def _moe_tokens(arch: Arch, pa: int, norm_bytes: int) -> int:
    """Bytes per token an MoE block saves (transformers 5.x grouped_mm experts, checked by saved-tensor
    hooks in tests/estimate/test_moe.py), its input norm included.

    Router: softmax over E experts in fp32, top-k indices (int64), and with renormalisation the sum
    and the original top-k values (fp32). Experts, for the S = tokens x k routed copies: the
    gathered input [S, h], the gate_up output [S, 2I] (SiLU reads the gate half, the product the
    up half), SiLU's output and the product [S, I] each, the down output [S, h] (saved by the
    multiplication with the routing weights, [S] of fp32 or the model dtype), and three int64
    index vectors of S (the gather, the weights' permutation, the inverse permutation).
    Shared expert (qwen2_moe): a dense gated MLP (4 x I_shared) and its output [T, h] with the
    sigmoid gate's output [T, 1].
    """
    h, k, E, I, Is = arch.hidden, arch.top_k, arch.experts, arch.expert_intermediate, arch.shared_intermediate
    router = 4 * E + 8 * k + ((4 + 4 * k) if arch.norm_topk else 0)
    if arch.router != "softmax":
        router = deepseek_router_bytes(arch, pa)
        if pa != 4 and not Is:      # the norm's 16-bit output: only the shared expert would save it
            norm_bytes -= h * pa
    experts = k * ((2 * h + 4 * I) * pa + (4 if arch.router_fp32_weights else pa) + 3 * 8)
    shared = (4 * Is * pa + ((h * pa + pa) if arch.shared_gate else 0)) if Is else 0
    return norm_bytes + router + experts + shared


def deepseek_router_bytes(arch: Arch, pa: int) -> int:
    """Bytes a token DeepSeek's fp32 router holds for backward (DeepseekV2TopkRouter /
    DeepseekV3TopkRouter): the fp32 copy of its input in 16-bit models (F.linear(hidden.float(),
    weight)), the scores (softmax or sigmoid output, [E] fp32) and the chosen experts' int64
    indices; V2's group-limited routing keeps the bool mask over the experts (its masked scores
    feed the top k); V3 renormalises (the sum, the weights). The group choice itself saves
    indices ([G], V3 [G, 2]; [topk_group]) and V3 its mask, but topk(...)[1] drops the values and
    with them those nodes: freed during forward, not held."""
    h, k, E = arch.hidden, arch.top_k, arch.experts
    out = (4 * h if pa != 4 else 0) + 4 * E + 8 * k
    if arch.router == "group_limited_greedy":
        out += E
    elif arch.router == "noaux_tc" and arch.norm_topk:
        out += 4 + 4 * k
    return out


def deepseek_moe_backward_transient(arch: Arch, tokens: int, pa: int, checkpointed: bool = False) -> int:
    """Live above a DeepSeek MoE layer's saved activations while it runs backward (transformers'
    grouped_mm experts; the shared expert runs backward first, its nodes being the newest), the
    larger of two moments (checked against --measure's traced step, tests/estimate/test_mla.py):

    - the gate_up grouped_mm's backward: it makes the gradient of its input [S, h] and of all the
      experts' gate_up weights at once, while its incoming [S, 2I] gradient and its saved input are
      alive; the down weights' gradient exists;
    - the chunk's backward (cat of the gate and up gradients, [S, I] each, into [S, 2I]).
    Both after the down output, the routing weights, the inverse permutation, the product, SiLU's
    output and the gate_up output were freed; meanwhile the routing weights' gradient ([S] fp32),
    the shared expert's weight gradients and its input gradient ([T, h]) and the layer's incoming
    gradient ([T, h]) wait, and the shared expert's saved tensors are gone.
    checkpointed (non-reentrant gradient checkpointing): a recomputed tensor is held by the
    checkpoint's frame only until its node unpacks it (torch/utils/checkpoint.py unpack_hook drops
    the handle), so the down output [S, h] dies when the product's backward returns, before the
    engine casts that backward's fp32 gradient back to 16 bits (validate_outputs); without
    checkpointing the node's saved variable holds it through the cast. On an H100 (issue 34's
    estmla run, V2-Lite bf16 b16 checkpointed) the peak was the product's second fp32 gradient,
    the cast no higher.
    """
    h, E, I, Is = arch.hidden, arch.experts, arch.expert_intermediate, arch.shared_intermediate
    S = tokens * arch.top_k
    # [T, h] gradients waiting: in fp32 the layer's incoming one and the shared expert's input
    # gradient; in 16 bits one 16-bit tensor (fitted to the traced steps: fp32 exact, and in bf16
    # one [T, h] 16-bit tensor less at every size tried)
    waiting_t = tokens * h * (8 if pa == 4 else pa)
    waiting = 4 * S + 3 * h * Is * pa + waiting_t
    freed = S * (h + 4 * I) * pa + 12 * S + tokens * 4 * Is * pa
    gate_up = 3 * E * I * h * pa + S * (2 * I + h) * pa
    cat = E * h * I * pa + 4 * S * I * pa
    # the routing-weight product's backward, first: the fp32 [S, h] gradient the inverse
    # permutation's index_put makes, the product's two fp32 [S, h] gradients (for the down output
    # and, before its row sum, for the weights), the first cast back to the model's dtype; only the
    # inverse permutation (int64 [S]) is freed yet
    weights_mul = S * h * (12 + (pa if pa != 4 and not checkpointed else 0)) - 8 * S
    shared = 3 * h * Is * pa + waiting_t - tokens * 4 * Is * pa
    return max(max(gate_up, cat) + waiting - freed, weights_mul + shared)


def moe_backward_transient(arch: Arch, tokens: int, pa: int) -> int:
    """Live above the saved activations while an MoE block runs backward (grouped_mm experts), the
    larger of two moments (fitted to CPU steps, tests/estimate/test_moe.py):

    - the routing-weight product's backward: its incoming gradient, the gradient of the down
      output and the product for the weights' gradient, [S, h] each in the product's dtype (fp32
      when the routing weights are fp32, as in mixtral; then the down output's gradient is also
      cast back to the model dtype); a shared expert's output gradient ([T, h], qwen2_moe: its
      gate's product runs backward first, its MLP after the experts) waits meanwhile;
    - the gate_up backward: the down projection's weight gradient (all experts) exists, and the
      [S, 2I] gradient of the gate_up output is built while the down output and the gathered
      copies are already freed: S x (2I - h).
    The residual stream's gradient that entered the layer ([T, h]) lives through both.
    """
    h, k, E, I = arch.hidden, arch.top_k, arch.experts, arch.expert_intermediate
    S = tokens * k
    wb = 4 if arch.router_fp32_weights else pa
    incoming = tokens * h * (2 if pa == 2 else 4)
    shared = tokens * h * pa if arch.shared_intermediate else 0
    weights_mul = S * (h * (3 * wb + (pa if wb != pa else 0)) - 8) + shared
    # before it, the inverse permutation's backward (`weighted_out[inv_perm]`): the contiguous copy
    # of the incoming [S, h] gradient, the zeros and the index_put into them, while the inverse
    # permutation (int64 [S]) is still saved: the higher one when no cast back follows (the routing
    # weights in the model's dtype, qwen3_moe: 8 x S under without it, --measure's traced step)
    inv_perm = 3 * S * h * wb + shared if not arch.shared_intermediate else 0
    gate_up = E * h * I * pa + S * ((2 * I - h) * pa - 8)
    return max(weights_mul, inv_perm, gate_up) + incoming
