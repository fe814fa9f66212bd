"""The whole estimate (all phases, not only the saved activations) against a real training step
on the CPU: the profiler's memory events give every allocation and free of torch's CPU allocator,
so replaying them gives the CPU equivalent of max_memory_allocated. Same ops, same tensors as on a
GPU, except the attention kernel (eager attention here, so both sides run the same code)."""
import json
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from gpumon.estimate import Setup, arch_from_config, estimate  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from tiny_models import TinyLlama, add_lora  # noqa: E402

CFG = Path(__file__).resolve().parents[1] / "fixtures" / "configs"


def cpu_peak(fn) -> int:
    """Peak live bytes above the starting point while fn runs, from the profiler's memory events."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    cur = peak = 0
    for _, b in events:
        cur += b
        peak = max(peak, cur)
    return peak


class Lion(torch.optim.Optimizer):
    """lion-pytorch's Lion (its update_fn, as published): not in torch itself."""

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad, lr, wd, (beta1, beta2) = p.grad, group["lr"], group["weight_decay"], group["betas"]
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p)
                exp_avg = state["exp_avg"]
                p.data.mul_(1 - lr * wd)
                update = exp_avg.clone().mul_(beta1).add(grad, alpha=1 - beta1).sign_()
                p.add_(update, alpha=-lr)
                exp_avg.mul_(beta2).add_(grad, alpha=1 - beta2)


def measured_step_peak(cfg, B, L, impl, loss, dtype, amp=False, ckpt=False, optimizer="adamw", lora=0, accum=1):
    torch.manual_seed(0)
    m = TinyLlama(cfg, "eager", checkpointing=ckpt).to(dtype)
    if lora:
        add_lora(m, lora)
    m.train()
    params = [p for p in m.parameters() if p.requires_grad]
    if optimizer == "adamw":
        kw = {"fused": True} if impl == "fused" else {"foreach": impl == "foreach"}
        opt = torch.optim.AdamW(params, lr=1e-4, **kw)
    elif optimizer == "adafactor":
        opt = torch.optim.Adafactor(params, lr=1e-2, foreach=impl == "foreach")
    elif optimizer == "lion":
        opt = Lion(params)
    else:
        opt = torch.optim.SGD(params, lr=1e-4, momentum=0.9, foreach=impl == "foreach")
    ids = torch.randint(0, cfg["vocab_size"], (B, L))

    def step():
        for _ in range(accum):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
                out = m(ids)
                if loss == "ce":
                    lo = F.cross_entropy(out.float().view(-1, out.shape[-1]), ids.view(-1))
                else:
                    lo = out.mean()
            del out
            lo.backward()
            del lo
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()   # the optimizer state appears
    live = sum(p.numel() * p.element_size() for p in m.parameters())
    live += sum(t.numel() * t.element_size() for st in opt.state.values() for t in st.values()
                if torch.is_tensor(t) and t.dim() > 0)
    return live + cpu_peak(step)


def test_lora_and_accumulation_steps():
    """Frozen base + LoRA adapters, and gradient accumulation (gradients alive during forward)."""
    failures = []
    for name, B, L, lora, accum, loss in [("llama-tiny", 4, 128, 8, 1, "ce"), ("qwen-small", 4, 128, 8, 1, "ce"),
                                          ("llama-tiny", 2, 64, 0, 2, "ce"), ("qwen-small", 1, 16, 0, 2, "mean")]:
        cfg = json.loads((CFG / f"{name}.json").read_text())
        cfg["num_hidden_layers"] = 2
        measured = measured_step_peak(cfg, B, L, "foreach", loss, torch.float32, lora=lora, accum=accum)
        e = estimate(Setup(arch=arch_from_config(cfg), batch=B, seq=L, loss=loss, attn="eager", workspace_bytes=0,
                           lora_rank=lora, grads_in_forward=accum > 1))
        err = (e.peak_bytes - measured) / measured
        if abs(err) > 0.01:
            failures.append(f"{name} lora={lora} accum={accum}: estimate {e.peak_bytes} measured {measured} "
                            f"({100 * err:+.2f}%), {e.peak_moment}")
    assert not failures, failures


@pytest.mark.parametrize("name,B,L,impl,loss,dtype,amp,ckpt,opt", [
    ("qwen-small", 2, 64, "foreach", "ce", "fp32", False, False, "adamw"),       # tied embedding
    ("qwen-small", 1, 16, "fused", "mean", "fp32", False, False, "adamw"),      # peak at the end of backward
    ("qwen-small", 1, 16, "foreach", "mean", "fp32", False, False, "adamw"),    # peak in the optimizer step
    ("qwen-small", 1, 16, "for-loop", "mean", "fp32", False, False, "adamw"),
    ("llama-tiny", 4, 128, "fused", "ce", "bf16", False, False, "adamw"),       # untied, bf16 weights
    ("llama-tiny", 4, 128, "foreach", "ce", "fp32", False, False, "sgd-momentum"),
    ("llama-tiny", 4, 128, "fused", "ce", "fp32", False, True, "adamw"),        # checkpointing
    ("llama-tiny", 4, 128, "fused", "ce", "bf16", True, False, "adamw"),        # autocast
    ("llama-tiny", 4, 128, "fused", "ce", "bf16", True, True, "adamw"),         # autocast + checkpointing
    ("qwen-small", 2, 64, "foreach", "ce", "bf16", True, False, "adamw"),       # autocast, tied
    ("qwen-small", 1, 16, "fused", "mean", "bf16", True, False, "adamw"),       # autocast, tied, end of backward
    ("llama-tiny", 1, 16, "foreach", "mean", "fp32", False, False, "adafactor"),  # var_estimates: 1 x N
    ("llama-tiny", 1, 16, "for-loop", "mean", "fp32", False, False, "adafactor"),
    ("llama-tiny", 4, 128, "foreach", "ce", "bf16", False, False, "adafactor"),
    ("llama-tiny", 1, 16, "for-loop", "mean", "fp32", False, False, "lion"),      # clone + add: 2 x largest
    # Adafactor's default (for-loop) with a tied embedding, peak at the end of backward: the H100's
    # -0.86% on Qwen2.5-0.5B at batch 1 is the allocator's block rounding, not the formula (byte-exact here)
    ("qwen-small", 1, 16, "for-loop", "mean", "fp32", False, False, "adafactor"),
])
def test_estimate_matches_cpu_training_step_peak(name, B, L, impl, loss, dtype, amp, ckpt, opt):
    cfg = json.loads((CFG / f"{name}.json").read_text())
    cfg["num_hidden_layers"] = 2
    tdt = torch.float32 if (dtype == "fp32" or amp) else torch.bfloat16
    measured = measured_step_peak(cfg, B, L, impl, loss, tdt, amp, ckpt, opt)
    e = estimate(Setup(arch=arch_from_config(cfg), batch=B, seq=L, dtype=dtype, amp=amp, impl=impl,
                       optimizer=opt, loss=loss, attn="eager", checkpointing=ckpt, workspace_bytes=0))
    err = (e.peak_bytes - measured) / measured
    assert abs(err) < 0.01, f"estimate {e.peak_bytes} measured {measured} ({100 * err:+.2f}%), {e.peak_moment}"
