"""Optimizer state and step temporaries, derived from torch/optim/*.py (torch 2.x).

State is allocated lazily in the first step() and lives from then on. Temporaries exist only
inside step(), on top of parameters + gradients + state:

- AdamW/Adam foreach (the default on CUDA, `_multi_tensor_adam`): `exp_avg_sq_sqrt =
  torch._foreach_sqrt(exp_avg_sqs)` materialises one tensor per parameter of a device/dtype group
  at once: 1 x trainable N x state bytes. (Adam with L2 weight decay first makes
  `device_grads = _foreach_add(grads, params)`, +1 x N, but deletes it before the sqrt: the peak
  stays 1 x N.)
- for-loop (foreach=False, `_single_tensor_adam`): `denom = (exp_avg_sq.sqrt() / bc2_sqrt).add_(eps)`
  holds the sqrt and the quotient of one parameter at once: 2 x the largest parameter, and the
  previous parameter's `denom` stays bound until the new one is assigned: with the parameter
  order known (--config), max over consecutive parameters of previous + 2 x current
  (+1 for Adam with L2 weight decay, whose `grad.add(param)` copy lives through the update).
- fused (`_fused_adamw_`): one kernel, no parameter-sized temporaries.
- SGD: momentum buffer = state (1 x N, created by cloning the gradient in the first step);
  weight decay makes a foreach copy of the gradients (1 x N) or a per-parameter copy (for-loop).
- Adafactor (torch.optim.Adafactor): factored row/column variances for >=2-D parameters, a full
  variance for vectors; foreach builds `var_estimates` (row @ col) for every parameter: 1 x N.
- Lion (lion-pytorch): one momentum buffer; the update `exp_avg.clone().mul_(beta1).add(grad, ...)
  .sign_()` holds the clone and the out-of-place sum of one parameter at once: 2 x largest.
- 8-bit Adam (bitsandbytes): two uint8 states plus one fp32 absmax per 256-element block for
  parameters of >= 4096 elements (smaller ones keep 32-bit state); fused kernel, no temporaries.
"""
from __future__ import annotations

from dataclasses import dataclass

# bitsandbytes Optimizer2State: min_8bit_size=4096 (smaller tensors keep fp32 state); blockwise
# quantisation with 256-element blocks for the 8-bit states
MIN_8BIT_SIZE = 4096
BNB_BLOCK = 256
OPTIMIZERS = ("adamw", "adam", "sgd", "sgd-momentum", "adafactor", "adamw8bit", "lion")
IMPLS = ("foreach", "fused", "for-loop")
DEVICES = ("cuda", "cpu")
# Devices whose tensors torch's _default_to_fused_or_foreach sends to foreach
# (torch/utils/_foreach_utils.py: _get_foreach_kernels_supported_devices).
_FOREACH_DEVICES = ("cuda", "xpu", "mtia")
# Which implementations each optimizer has (torch.optim; bitsandbytes and lion-pytorch have one each).
_HAS = {"adamw": IMPLS, "adam": IMPLS, "sgd": IMPLS, "sgd-momentum": IMPLS,
        "adafactor": ("foreach", "for-loop"), "adamw8bit": ("fused",), "lion": ("for-loop",)}


def default_impl(name: str, device: str = "cuda") -> tuple[str, str]:
    """The implementation an optimizer runs when the user passes neither foreach= nor fused=,
    as torch picks it on `device`, and why (read from torch/optim/*.py, 2.x):

    - Adam, AdamW, SGD: `if foreach is None and fused is None: _default_to_fused_or_foreach(
      params, differentiable=False, use_fused=False)`: foreach when every parameter is on a
      foreach device (CUDA), else the single-tensor for-loop (CPU). Never fused by default.
    - Adafactor (torch/optim/_adafactor.py): `if foreach: _multi_tensor_adafactor else
      _single_tensor_adafactor`, with no default picked: foreach=None runs the for-loop everywhere.
    - bitsandbytes' AdamW8bit: one fused 8-bit kernel; lion-pytorch: a per-parameter loop.
    """
    name = name.lower()
    if name not in _HAS:
        raise ValueError(f"unknown optimizer {name!r} (choose from {', '.join(OPTIMIZERS)})")
    if device not in DEVICES:
        raise ValueError(f"unknown device {device!r} (choose from {', '.join(DEVICES)})")
    if name in ("adamw", "adam", "sgd", "sgd-momentum"):
        cls = {"adamw": "AdamW", "adam": "Adam"}.get(name, "SGD")
        if device in _FOREACH_DEVICES:
            return "foreach", f"torch.optim.{cls}'s default on {device} (foreach=None, fused=None picks foreach)"
        return "for-loop", f"torch.optim.{cls}'s default on {device} (foreach is only picked for CUDA tensors)"
    if name == "adafactor":
        return "for-loop", ("torch.optim.Adafactor's default (foreach=None runs _single_tensor_adafactor; "
                            "pass foreach=True for foreach)")
    if name == "adamw8bit":
        return "fused", "bitsandbytes AdamW8bit: one fused 8-bit kernel"
    return "for-loop", "lion-pytorch: a per-parameter update"


def check_impl(name: str, impl: str) -> None:
    """An implementation the optimizer does not have is an error, not a silent other number."""
    name = name.lower()
    if impl not in IMPLS:
        raise ValueError(f"unknown optimizer implementation {impl!r} (choose from {', '.join(IMPLS)})")
    has = _HAS.get(name)
    if has is not None and impl not in has:
        raise ValueError(f"{name} has no {impl} implementation (it has: {', '.join(has)})")


@dataclass
class OptimizerCost:
    state_bytes: int
    temp_bytes: int
    state_desc: str
    temp_desc: str


def _loop_peak(ordered: list[int], per_current: int) -> int:
    """Elements live at once in a per-parameter loop that makes `per_current` temporaries of the
    parameter in hand while the previous parameter's last one is still bound to a local name
    (`denom`, `update`, `var_estimate`: Python frees it only when the name is rebound, after the
    new ones exist)."""
    best, prev = 0, 0
    for n in ordered:
        best = max(best, prev + per_current * n)
        prev = n
    return best


def adamw8bit_state_bytes(numels) -> int:
    """bitsandbytes' 8-bit Adam state for these parameter sizes (Optimizer2State.init_state): a
    tensor of >= MIN_8BIT_SIZE elements keeps two uint8 states and one fp32 absmax per 256-element
    block for each (blockwise quantisation); a smaller one keeps two fp32 states."""
    total = 0
    for n in numels:
        if n < MIN_8BIT_SIZE:
            total += 2 * 4 * n
        else:
            total += 2 * n + 2 * 4 * (-(-n // BNB_BLOCK))
    return total


def optimizer_cost(name: str, impl: str, n_trainable: int, largest_trainable: int, state_bytes_per: int,
                   weight_decay: bool = True, factored_elems: int | None = None,
                   ordered: list[int] | None = None, shapes: list[tuple[int, ...]] | None = None) -> OptimizerCost:
    """State and step-temporary bytes.

    n_trainable: trainable elements; largest_trainable: elements of the largest trainable tensor;
    state_bytes_per: bytes of one state element (the parameter dtype unless told otherwise);
    shapes: the trainable parameters' shapes, which Adafactor's factored state and 8-bit Adam's
    blocks are computed from (factored_elems may give Adafactor's directly). Without them
    (--params alone) Adafactor is refused rather than guessed (it was N/1000: -69% to +187%),
    and 8-bit Adam is taken as one tensor, which the estimate says.
    """
    s, n, big = state_bytes_per, n_trainable, largest_trainable
    name = name.lower()
    if impl not in IMPLS:
        raise ValueError(f"unknown optimizer implementation {impl!r} (choose from {', '.join(IMPLS)})")
    if name in ("adamw", "adam"):
        state = 2 * n * s
        l2 = name == "adam" and weight_decay
        if impl == "foreach":
            return OptimizerCost(state, n * s, "exp_avg + exp_avg_sq: 2 x N x state bytes",
                                 "foreach: _foreach_sqrt(exp_avg_sq) for all params at once: 1 x N")
        if impl == "for-loop":
            k = 3 if l2 else 2
            if ordered:
                return OptimizerCost(state, _loop_peak(ordered, k) * s, "exp_avg + exp_avg_sq: 2 x N x state bytes",
                                     f"for-loop: sqrt and quotient of one param{' + L2 grad copy' if l2 else ''} "
                                     "while the previous param's denom is still bound")
            return OptimizerCost(state, k * big * s, "exp_avg + exp_avg_sq: 2 x N x state bytes",
                                 f"for-loop: sqrt and quotient of one param{' + L2 grad copy' if l2 else ''}: "
                                 f"{k} x largest param")
        return OptimizerCost(state, 0, "exp_avg + exp_avg_sq: 2 x N x state bytes", "fused kernel: none")
    if name in ("sgd", "sgd-momentum"):
        momentum = name == "sgd-momentum"
        state = n * s if momentum else 0
        if weight_decay:
            temp = n * s if impl == "foreach" else (big * s if impl == "for-loop" else 0)
            tdesc = "weight decay: grad + wd*param copy"
        else:
            temp, tdesc = 0, "none (in-place updates)"
        return OptimizerCost(state, temp, "momentum buffer: 1 x N" if momentum else "none", tdesc)
    if name == "adafactor":
        if factored_elems is None and shapes is None:
            raise ValueError("adafactor's state depends on each parameter's shape (factored rows and columns "
                             "for matrices): give --config or --measure, not --params alone")
        fac = factored_elems if factored_elems is not None else _factored(shapes)
        state = fac * s
        temp = n * s if impl == "foreach" else (_loop_peak(ordered, 1) if ordered else big) * s
        return OptimizerCost(state, temp, "factored row/col variances (vectors: full variance)",
                             "var_estimates (row @ col): 1 x N (foreach) / 1 x largest (for-loop)")
    if name == "adamw8bit":
        if shapes is not None:
            state = adamw8bit_state_bytes(_numel(sh) for sh in shapes)
            small = sum(1 for sh in shapes if _numel(sh) < MIN_8BIT_SIZE)
            desc = (f"bitsandbytes: 2 x uint8 + an fp32 absmax per {BNB_BLOCK}-element block for each tensor of "
                    f">= {MIN_8BIT_SIZE} elements; 2 x fp32 for the {small} smaller ones")
        else:
            state = adamw8bit_state_bytes([n])
            desc = (f"bitsandbytes: 2 x N uint8 + fp32 absmax per {BNB_BLOCK}-block (shapes unknown: tensors under "
                    f"{MIN_8BIT_SIZE} elements keep 32-bit state, not counted)")
        return OptimizerCost(state, 0, desc, "fused 8-bit kernel: none")
    if name == "lion":
        return OptimizerCost(n * s, (_loop_peak(ordered, 2) if ordered else 2 * big) * s, "exp_avg: 1 x N",
                             "update = sign(clone * beta1 + grad): clone and sum of one param, 2 x largest")
    raise ValueError(f"unknown optimizer {name!r} (choose from {', '.join(OPTIMIZERS)})")


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _factored(shapes) -> int:
    from .arch import factored_elems
    return factored_elems(shapes)
