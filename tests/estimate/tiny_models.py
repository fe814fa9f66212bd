"""Small torch models for the estimator's tests, written the way Hugging Face writes them
(Qwen2/Llama: RMSNorm upcast, rotary, grouped-query sdpa or eager attention, gated SiLU MLP)."""
from __future__ import annotations

import torch
import torch.utils.checkpoint
import torch.nn as nn
import torch.nn.functional as F


class RMSNorm(nn.Module):
    def __init__(self, h, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(h))
        self.eps = eps

    def forward(self, x):
        dt = x.dtype
        x = x.to(torch.float32)
        var = x.pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(var + self.eps)
        return self.weight * x.to(dt)


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def repeat_kv(x, n):
    if n == 1:
        return x
    b, kv, s, d = x.shape
    return x[:, :, None].expand(b, kv, n, s, d).reshape(b, kv * n, s, d)


class Attention(nn.Module):
    def __init__(self, h, heads, kv, bias, attn):
        super().__init__()
        self.hd, self.heads, self.kv, self.attn = h // heads, heads, kv, attn
        self.q_proj = nn.Linear(h, heads * self.hd, bias=bias)
        self.k_proj = nn.Linear(h, kv * self.hd, bias=bias)
        self.v_proj = nn.Linear(h, kv * self.hd, bias=bias)
        self.o_proj = nn.Linear(heads * self.hd, h, bias=False)

    def forward(self, x, cos, sin):
        B, L, _ = x.shape
        q = self.q_proj(x).view(B, L, -1, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(B, L, -1, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(B, L, -1, self.hd).transpose(1, 2)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q = (q * cos) + (rotate_half(q) * sin)
        k = (k * cos) + (rotate_half(k) * sin)
        scale = self.hd ** -0.5
        if self.attn == "eager":
            k, v = repeat_kv(k, self.heads // self.kv), repeat_kv(v, self.heads // self.kv)
            w = torch.matmul(q, k.transpose(2, 3)) * scale
            mask = torch.full((L, L), float("-inf"), device=x.device, dtype=w.dtype).triu(1)
            w = w + mask
            w = F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
            w = F.dropout(w, p=0.0, training=self.training)
            o = torch.matmul(w, v)
        else:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                               enable_gqa=self.kv != self.heads)
        o = o.transpose(1, 2).contiguous().reshape(B, L, -1)
        return self.o_proj(o)


class MLP(nn.Module):
    def __init__(self, h, i):
        super().__init__()
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, h, i, heads, kv, bias, attn):
        super().__init__()
        self.input_layernorm = RMSNorm(h)
        self.self_attn = Attention(h, heads, kv, bias, attn)
        self.post_attention_layernorm = RMSNorm(h)
        self.mlp = MLP(h, i)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class TinyLlama(nn.Module):
    """Qwen2/Llama-shaped decoder: config keys as in config.json."""

    def __init__(self, cfg: dict, attn: str = "sdpa", checkpointing: bool = False):
        super().__init__()
        self.checkpointing = checkpointing
        h, self.hd = cfg["hidden_size"], cfg["hidden_size"] // cfg["num_attention_heads"]
        bias = cfg.get("model_type") == "qwen2"
        self.vocab_size = cfg["vocab_size"]
        self.embed_tokens = nn.Embedding(cfg["vocab_size"], h)
        self.layers = nn.ModuleList(Layer(h, cfg["intermediate_size"], cfg["num_attention_heads"],
                                          cfg["num_key_value_heads"], bias, attn)
                                    for _ in range(cfg["num_hidden_layers"]))
        self.norm = RMSNorm(h)
        self.lm_head = nn.Linear(h, cfg["vocab_size"], bias=False)
        if cfg.get("tie_word_embeddings"):
            self.lm_head.weight = self.embed_tokens.weight
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, self.hd, 2).float() / self.hd)),
                             persistent=False)

    def get_output_embeddings(self):
        return self.lm_head

    def forward(self, ids):
        B, L = ids.shape
        x = self.embed_tokens(ids)
        pos = torch.arange(L, device=ids.device)[None].expand(B, L)
        # as Hugging Face's rotary embedding does: this is what the meta device cannot run
        with torch.no_grad(), torch.autocast(device_type=ids.device.type, enabled=False):
            freqs = (self.inv_freq[None, :, None].float() @ pos[:, None, :].float()).transpose(1, 2)
            emb = torch.cat((freqs, freqs), dim=-1)
            cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        for layer in self.layers:
            if self.checkpointing and self.training:
                x = torch.utils.checkpoint.checkpoint(layer, x, cos, sin, use_reentrant=False)
            else:
                x = layer(x, cos, sin)
        return self.lm_head(self.norm(x))


class LoRALinear(nn.Module):
    """peft-style LoRA around a frozen Linear: base(x) + B(A(x)) * alpha / r (no dropout)."""

    def __init__(self, base: nn.Linear, r: int, alpha: float = 16.0):
        super().__init__()
        self.base = base
        self.lora_A = nn.Linear(base.in_features, r, bias=False)
        self.lora_B = nn.Linear(r, base.out_features, bias=False)
        nn.init.zeros_(self.lora_B.weight)
        self.scaling = alpha / r

    def forward(self, x):
        return self.base(x) + self.lora_B(self.lora_A(x)) * self.scaling


def add_lora(model: nn.Module, r: int, targets=("q_proj", "v_proj")) -> nn.Module:
    """Freeze every weight, then wrap the target Linears with trainable adapters (as peft does)."""
    for p in model.parameters():
        p.requires_grad_(False)
    for mod in list(model.modules()):
        for name, child in list(mod.named_children()):
            if name in targets and isinstance(child, nn.Linear):
                setattr(mod, name, LoRALinear(child, r))
    return model


class EncoderLM(nn.Module):
    """examples/train.py's model: Embedding, nn.TransformerEncoder with a causal mask, head."""

    def __init__(self, vocab=100, d=32, layers=2, heads=4):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        layer = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, x):
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1], device=x.device)
        return self.head(self.norm(self.blocks(self.embed(x), mask=mask, is_causal=True)))


def mlp_model(d_in=64, d_hidden=256, depth=3):
    layers = []
    d = d_in
    for _ in range(depth):
        layers += [nn.Linear(d, d_hidden), nn.GELU(), nn.LayerNorm(d_hidden)]
        d = d_hidden
    layers.append(nn.Linear(d, 10))
    return nn.Sequential(*layers)


def _mean_loss(out):
    """The loss the saved-bytes counts use: the output's (or a Hugging Face output's logits') mean."""
    out = out if torch.is_tensor(out) else out.logits
    return out.float().mean()


def saved_bytes_direct(model, inp, loss_fn=_mean_loss):
    """Autograd's saved bytes of one forward, read directly on real tensors (CPU or CUDA), storages
    deduplicated; parameters and buffers left out. The one copy: tests/estimate and tests/gpu."""
    skip = {p.untyped_storage().data_ptr() for p in model.parameters()}
    skip |= {b.untyped_storage().data_ptr() for b in model.buffers()}
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in skip:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(inp)
    loss_fn(out).backward()
    return sum(seen.values())


def hf_model(cfg: dict, dtype=torch.float32, device: str | None = None, attn: str = "eager"):
    """transformers' causal LM built from a config dict (model_type included; random weights, seed 0,
    no KV cache), in training mode. device "meta" builds it without memory (parameter counts);
    "cuda" builds it on the GPU. The one copy: test_moe, tests/gpu/test_estimate_gpu."""
    import transformers
    c = dict(cfg)
    mt = c.pop("model_type")
    c["use_cache"] = False
    conf = transformers.AutoConfig.for_model(mt, **c)
    torch.manual_seed(0)
    if device == "meta":
        with torch.device("meta"):
            return transformers.AutoModelForCausalLM.from_config(conf)
    with torch.device(device or "cpu"):
        m = transformers.AutoModelForCausalLM.from_config(conf, attn_implementation=attn, dtype=dtype)
    m.train()
    return m
