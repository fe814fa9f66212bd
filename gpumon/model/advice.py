"""Advice derived only from measured figures: each item says what to change, the figure that
triggered it and what it should save. Pure: takes a BreakdownModel (gpumon/model/breakdown.py).

The rules (each tested both ways in tests/phases/test_model_advice.py):
* the run's peak falls in the optimizer step of a foreach optimizer -> fused=True or
  foreach=False; saving: what is alive there beyond parameters, gradients and optimizer state
  (the step's temporaries). Not for fused or for-loop optimizers, nor a peak elsewhere.
* the peak falls in forward/backward and activations are more than half of it -> gradient
  checkpointing, a smaller micro-batch with accumulation, bf16 autocast (unless the forward
  already ran under autocast).
* the model's output (logits, measured as the largest tensor its forward returns) is more than
  20% of the activations at the peak -> compute the loss in chunks.
* reserved far above the peak allocated (> 10% of the peak and > 1 GiB), or allocation retries
  rising -> ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``. (Reserved minus the *current*
  allocated is no sign of trouble: between steps the cache holds the freed activations for the
  next step.)
* non-PyTorch memory (NVML process used - reserved) above 2 GiB -> what it usually is.
"""
from __future__ import annotations

from dataclasses import dataclass

from gpumon.model.breakdown import BreakdownModel

GiB = 1024 ** 3


@dataclass
class Advice:
    title: str
    trigger: str    # the measured figure
    saving: str     # what it should save


def _g(n: int) -> str:
    return f"{n / GiB:.1f} GiB"


def advise(m: BreakdownModel, logits_bytes: int | None = None) -> list[Advice]:
    """logits_bytes: overrides the measured model output size (the agent's ``output_bytes``)."""
    d = m.main_device()
    if d is None:
        return []
    out: list[Advice] = []
    # exact figures only: the run's high-water mark (its phase is known only when gpumon saw
    # it set) or the last exactly measured step's peak, never a lower bound
    exact_step = d.peak_exact and d.peak_phase is not None
    if d.run_peak_phase is not None:
        peak, phase, roles = d.run_peak, d.run_peak_phase, d.at_run_peak
        if roles is None and exact_step and d.peak_phase == phase and d.peak == peak:
            roles = d.at_peak
    elif exact_step:
        peak, phase, roles = d.peak, d.peak_phase, d.at_peak
    else:
        peak, phase, roles = d.run_peak, None, None
    roles = roles or {}
    if phase == "optimizer" and peak:
        foreach = [name for name, impl in zip(m.optimizers, m.optimizer_impl or [])
                   if impl == "foreach"]
        tmp = roles.get("activations")
        if foreach and tmp and tmp > 0.05 * peak:
            out.append(Advice(
                f"{'/'.join(foreach)}: use fused=True (or foreach=False)",
                f"the peak {_g(peak)} falls in the optimizer step; {_g(tmp)} of it is beyond "
                "parameters, gradients and optimizer state (the foreach step's temporaries)",
                f"up to {_g(tmp)} (measured on a 1.5B model: 28.8 -> 24.8 GiB)"))
    act = roles.get("activations")
    if phase in ("forward", "backward") and peak and act and act > 0.5 * peak:
        # a forward measured under autocast already has it: suggesting it would be wrong
        suggest_autocast = not isinstance(m.autocast, str)
        out.append(Advice(
            "activations dominate: gradient checkpointing, a smaller micro-batch with "
            "gradient accumulation" + (", or bf16 autocast" if suggest_autocast else ""),
            f"activations and temporaries {_g(act)} of the {_g(peak)} peak "
            f"({100 * act / peak:.0f}%), in {phase}"
            + ("" if suggest_autocast else f", under {m.autocast} autocast already"),
            f"checkpointing: most of {_g(act)} (each layer keeps only its input); half the "
            f"micro-batch: ~{_g(act // 2)}"
            + (f"; bf16 autocast: ~{_g(act // 2)}" if suggest_autocast else "")))
        logits = logits_bytes if logits_bytes is not None else m.output_bytes
        if logits and logits > 0.2 * act:
            out.append(Advice(
                "large logits: compute the loss in chunks (or keep the logits in bf16)",
                f"the model's output is {_g(logits)} ({100 * logits / act:.0f}% of the "
                "activations at the peak)",
                f"most of {_g(logits)}, and as much again for its fp32 copies in the loss"))
    if d.reserved is not None and peak:
        slack = d.reserved - peak
        big = slack > 0.10 * peak and slack > GiB
        if big or d.retries_rising:
            why = f"reserved {_g(d.reserved)} vs a peak allocated of {_g(peak)}"
            if d.retries_rising:
                why += f"; allocation retries rising ({d.retries})"
            out.append(Advice(
                "set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True", why,
                (f"up to {_g(slack)} of fragmentation" if slack > 0 else "the retries' cost")
                + " (measured: reserved 49.5 -> 44.0 GiB at the same peak)"))
    np_ = d.now.get("non_pytorch")
    if np_ is not None and np_ > 2 * GiB:
        out.append(Advice(
            "large non-PyTorch memory: CUDA context (~0.6 GiB), cuBLAS/cuDNN workspaces, NCCL "
            "buffers, or another library's allocations (cupy, TensorRT, JAX)",
            f"NVML process used - reserved = {_g(np_)}",
            "NCCL: a smaller NCCL_BUFFSIZE or fewer channels; cuBLAS: CUBLAS_WORKSPACE_CONFIG"))
    return out
