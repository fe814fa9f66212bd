"""--measure counts sdpa as CUDA's fused kernel saves it, also behind Hugging Face's mask logic.

transformers 5.x builds an explicit causal mask when it sees fake tensors (its is_tracing() is True
for a FakeTensor in find_packed_sequence_indices), which on a GPU it skips; with a mask, sdpa would
be counted as the math kernel (B x H x L x L probabilities). transformers is not needed here: a stand-in
`transformers.masking_utils` module with HF's decision rule is put in sys.modules.
"""
import sys
import types
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from gpumon.estimate.measure import measure_activations  # noqa: E402

B, L, H, D, V = 2, 48, 4, 16, 50
h = H * D


def _find_packed_sequence_indices(position_ids):
    """HF's rule: None (no packing) unless tracing, and a FakeTensor counts as tracing."""
    from torch._subclasses.fake_tensor import FakeTensor
    mask = (torch.diff(position_ids, prepend=position_ids[:, :1] - 1, dim=-1) != 1).cumsum(-1)
    if not isinstance(mask, FakeTensor) and bool((mask[:, -1] == 0).all()):
        return None
    return mask


@pytest.fixture
def fake_hf(monkeypatch):
    pkg = types.ModuleType("transformers")
    mu = types.ModuleType("transformers.masking_utils")
    mu.find_packed_sequence_indices = _find_packed_sequence_indices
    pkg.masking_utils = mu
    monkeypatch.setitem(sys.modules, "transformers", pkg)
    monkeypatch.setitem(sys.modules, "transformers.masking_utils", mu)
    return mu


class Attn(nn.Module):
    """Embedding -> fused qkv -> attention -> o_proj; the mask as HF's sdpa path makes it."""
    vocab_size = V

    def __init__(self, attn="sdpa", own_mask=False):
        super().__init__()
        self.attn, self.own_mask = attn, own_mask
        self.emb = nn.Embedding(V, h)
        self.qkv = nn.Linear(h, 3 * h, bias=False)
        self.o_proj = nn.Linear(h, h, bias=False)

    def forward(self, ids):
        b, l = ids.shape
        x = self.emb(ids)
        q, k, v = self.qkv(x).view(b, l, 3, H, D).permute(2, 0, 3, 1, 4).unbind(0)
        if self.attn == "eager":
            w = (q @ k.transpose(-1, -2)) * D ** -0.5
            w = w + torch.full((l, l), float("-inf"), dtype=w.dtype, device=w.device).triu(1)
            o = w.softmax(-1) @ v
        else:
            pos = torch.arange(l, device=ids.device)[None].expand(b, l)
            packed = sys.modules["transformers.masking_utils"].find_packed_sequence_indices(pos)
            if packed is None and not self.own_mask:      # HF: mask skipped, is_causal
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:                   # HF: an explicit boolean causal (and packing) mask
                mask = torch.ones(l, l, dtype=torch.bool, device=ids.device).tril()[None, None].expand(b, 1, l, l)
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(o.transpose(1, 2).reshape(b, l, h))


def fused_by_hand(e: int, kernel: str = "efficient") -> int:
    """The fused kernel's saved set, plus the layer around it (bytes)."""
    ids = B * L * 8                         # the embedding's indices
    x = B * L * h * e                       # qkv's input
    qkv = B * L * 3 * h * e                 # q, k, v: views of one storage
    out = B * L * h * e                     # the kernel's output ([B, L, H, D]); o_proj reads it as a view
    # fp32 logsumexp: [B, H, L] from flash (flash_api.cpp), L padded to 32 by the memory-efficient kernel
    lse = B * H * (L if kernel == "flash" else -(-L // 32) * 32) * 4
    return ids + x + qkv + out + lse


@pytest.mark.parametrize("dtype,e,kernel", [("fp32", 4, "efficient"), ("bf16", 2, "flash")])
def test_sdpa_behind_hf_mask_logic_counts_the_fused_kernel(fake_hf, dtype, e, kernel):
    r = measure_activations(B, L, dtype, factory=lambda: Attn())
    assert r["attention"] == kernel
    assert r["saved_bytes"] == fused_by_hand(e, kernel)
    assert any(kernel in n and "logsumexp" in n for n in r["notes"])
    assert fake_hf.find_packed_sequence_indices is _find_packed_sequence_indices   # restored


def test_a_mask_of_the_model_own_is_counted_as_the_efficient_kernel_with_its_bias(fake_hf):
    # CUDA's sdpa with a mask: flash takes none, the memory-efficient kernel takes any (not GQA);
    # it saves the boolean mask converted to a bias of q's dtype (last dim padded to 16).
    # What the H200 saves is checked by tests/gpu/test_estimate_gpu.py.
    r = measure_activations(B, L, "fp32", factory=lambda: Attn(own_mask=True))
    assert r["attention"] == "efficient with a mask"
    assert r["saved_bytes"] == fused_by_hand(4) + B * 1 * L * L * 4
    assert any("mask" in n for n in r["notes"])


def test_a_grouped_query_mask_is_the_math_kernel():
    def f():
        class G(nn.Module):
            vocab_size = V

            def __init__(self):
                super().__init__()
                self.q = nn.Linear(h, h, bias=False)
                self.kv = nn.Linear(h, 2 * h // 2, bias=False)
                self.emb = nn.Embedding(V, h)

            def forward(self, ids):
                b, l = ids.shape
                x = self.emb(ids)
                q = self.q(x).view(b, l, H, D).transpose(1, 2)
                k, v = self.kv(x).view(b, l, 2, H // 2, D).permute(2, 0, 3, 1, 4).unbind(0)
                mask = torch.ones(l, l, dtype=torch.bool).tril()
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        return G()
    r = measure_activations(B, L, "fp32", factory=f)
    assert r["attention"] == "math"


def test_eager_attention_stays_exact(fake_hf):
    sys.path.insert(0, str(Path(__file__).parent))
    from tiny_models import saved_bytes_direct
    r = measure_activations(B, L, "fp32", factory=lambda: Attn("eager"), attn="eager")
    torch.manual_seed(0)
    direct = saved_bytes_direct(Attn("eager"), torch.zeros((B, L), dtype=torch.long))
    assert r["saved_bytes"] == direct
    assert r["attention"] == "eager"
