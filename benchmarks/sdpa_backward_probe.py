"""What one scaled_dot_product_attention backward allocates above its inputs on a GPU, per kernel:
the transient (workspace) that no saved tensor shows, for the estimator's attention terms.

    python benchmarks/sdpa_backward_probe.py [--out sdpa_backward.md]

For each case: q, k, v (leaves) and the upstream gradient exist; forward; then backward under a
reset peak. Reported (bytes): the peak above what was live before backward, and that peak less the
three input gradients (what the kernel needs besides its outputs). The kernel is read from the
output's grad_fn. Cases are the shapes of benchmarks/estimate_accuracy.py's rows.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

MiB = 2**20

# name, dtype, batch, heads, kv heads given to sdpa (== heads: k, v repeated by the caller), seq,
# head_dim, mask ("causal" | "window:N" boolean mask | "none"), enable_gqa
CASES = [
    ("mistral-sw fp32 b2 s1024 window", "float32", 2, 16, 16, 1024, 64, "window:512", False),
    ("mistral-sw bf16 b4 s2048 window", "bfloat16", 4, 16, 16, 2048, 64, "window:512", False),
    ("mistral-sw bf16 b8 s256 causal gqa", "bfloat16", 8, 16, 4, 256, 64, "causal", True),
    ("mistral-sw fp32 b8 s256 causal gqa", "float32", 8, 16, 4, 256, 64, "causal", True),
    ("qwen1.5b fp32 b16 s256 causal gqa", "float32", 16, 12, 2, 256, 128, "causal", True),
    ("qwen1.5b bf16 b8 s1024 causal gqa", "bfloat16", 8, 12, 2, 1024, 128, "causal", True),
    ("qwen0.5b bf16 b4 s512 causal gqa", "bfloat16", 4, 14, 2, 512, 64, "causal", True),
    ("llama-mha fp32 b4 s512 causal", "float32", 4, 16, 16, 512, 64, "causal", False),
]


def probe(torch, case, backend=None) -> str:
    name, dt, B, H, KV, L, D, mask, gqa = case
    dtype = getattr(torch, dt)
    F = torch.nn.functional
    dev = "cuda"
    q = torch.randn(B, H, L, D, device=dev, dtype=dtype, requires_grad=True)
    k = torch.randn(B, KV, L, D, device=dev, dtype=dtype, requires_grad=True)
    v = torch.randn(B, KV, L, D, device=dev, dtype=dtype, requires_grad=True)
    attn_mask, causal = None, mask == "causal"
    if mask.startswith("window:"):
        w = int(mask.split(":")[1])
        i = torch.arange(L, device=dev)
        attn_mask = ((i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < w))[None, None].expand(B, 1, L, L)
    ctx = torch.nn.attention.sdpa_kernel([backend]) if backend is not None else _null()
    try:
        with ctx:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=causal, enable_gqa=gqa)
    except RuntimeError as e:
        return f"| {name} | {backend.name if backend else 'default'} | refused: {str(e).splitlines()[0][:60]} | | | |"
    kernel = type(out.grad_fn).__name__.replace("Backward0", "")
    g = torch.randn_like(out)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with ctx:
        out.backward(g)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    grads = sum(t.grad.untyped_storage().nbytes() for t in (q, k, v))
    after = torch.cuda.memory_allocated() - before
    qb = q.numel() * q.element_size()
    res = (f"| {name} | {kernel} | {peak:,} | {peak - grads:,} | {(peak - grads) / qb:.3f} | "
           f"{after - grads:,} |")
    del q, k, v, out, g, attn_mask
    torch.cuda.empty_cache()
    return res


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        print("needs CUDA", file=sys.stderr)
        return 2
    from torch.nn.attention import SDPBackend
    lines = [f"# sdpa backward transients ({torch.cuda.get_device_name(0)}, torch {torch.__version__})", "",
             "peak = above what was live before backward; extra = peak less the q, k, v gradients; "
             "x q = extra in units of q's bytes; end = live after backward less the gradients", "",
             "| case | kernel | peak B | extra B | x q | end B |", "|---|---|---:|---:|---:|---:|"]
    for case in CASES:
        for be in (None, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION):
            lines.append(probe(torch, case, be))
            print(lines[-1], flush=True)
    if a.out:
        Path(a.out).write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
