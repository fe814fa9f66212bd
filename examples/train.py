"""A plain PyTorch training loop to try gpumon on a GPU (no gpumon import needed):

    gpumon run -- python examples/train.py                 # then, in another shell: gpumon ls / attach PID
    python examples/train.py --layers 4 --batch 4          # smaller

A decoder-only transformer (nn.TransformerEncoderLayer with a causal mask) trained on random
tokens with AdamW under bf16 autocast. Runs until --steps (default: forever) or Ctrl-C.
"""
import argparse
import time

import torch
import torch.nn as nn


class LM(nn.Module):
    def __init__(self, vocab, d, layers, heads):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        layer = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, batch_first=True,
                                           norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, x):
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1], device=x.device)
        return self.head(self.norm(self.blocks(self.embed(x), mask=mask, is_causal=True)))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--d", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=0, help="0: run until Ctrl-C")
    ap.add_argument("--sleep", type=float, default=0.0, help="pause between steps (s)")
    a = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    model = LM(a.vocab, a.d, a.layers, a.heads).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    n = sum(p.numel() for p in model.parameters())
    print(f"{n / 1e6:.0f}M parameters on {dev}", flush=True)
    step = 0
    while not a.steps or step < a.steps:
        x = torch.randint(0, a.vocab, (a.batch, a.seq), device=dev)
        t0 = time.perf_counter()
        with torch.autocast(dev, dtype=torch.bfloat16):
            logits = model(x[:, :-1])
        loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        if step % 10 == 0:
            print(f"step {step} loss {loss.item():.3f} {time.perf_counter() - t0:.3f} s", flush=True)
        if a.sleep:
            time.sleep(a.sleep)


if __name__ == "__main__":
    main()
