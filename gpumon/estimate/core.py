"""The estimator: terms, the step's phases, and the peak.

What it predicts: the bytes the tensors of a steady-state training step request at its peak (from
the second step on, when the optimizer state exists): `torch.cuda.memory_stats()
["requested_bytes.all.peak"]`. `torch.cuda.max_memory_allocated()` is that plus the allocator's
block rounding (ALLOCATOR_ROUNDING, given as a range), and the device-level (NVML) figure adds the
allocator's cached-but-free memory and the CUDA context (a range too).

What coexists when (zero_grad(set_to_none=True), the default since torch 2.0):
- forward: parameters + optimizer state + the activations saved so far. Gradients are None
  (unless gradients are kept: accumulation micro-steps after the first, or set_to_none=False).
- end of forward / start of backward: all saved activations, plus the logits and the loss's
  tensors (tokens x vocab, fp32 for the log-softmax), plus the first gradients (lm_head weight).
- backward, layer by layer from the last: gradients grow by one layer's parameters while saved
  activations shrink by one layer's; with checkpointing one layer is recomputed at a time.
- end of backward: every gradient is live, activations are gone; a tied embedding gets a second
  dense gradient from the embedding backward that is added in place (one extra V x h tensor).
- optimizer step: parameters + gradients + optimizer state + the step's temporaries.
So peak = params + optimizer state + max(forward/backward high-water mark, gradients + step
temporaries), which is the blog's formula with each branch made exact.
"""
from __future__ import annotations

from dataclasses import dataclass, field, asdict

from .activations import (BLOG_A_INTERCEPT, BLOG_A_SLOPE, ActivationModel, blog_heuristic_bytes,
                          transformer_activations)
from .arch import Arch
from .optim import check_impl, default_impl, optimizer_cost
from .units import GiB

DTYPE_BYTES = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2}
# Outside torch's allocated figure (FACTS.md: NVML used - reserved was 0.73 GiB in every run on an H200).
CUDA_CONTEXT_BYTES = (int(0.5 * GiB), int(0.75 * GiB))
# The allocator's cache at the peak, (reserved - allocated) / allocated: on the H200 runs of
# benchmarks/estimate_accuracy.md (no expandable segments) 5% to 23%, and 32% in one run with
# gradient checkpointing; on the H100's (2026-12-06) 2% to 21%, and 30% on the Qwen3-MoE
# Adafactor row (many small factored-state temporaries); ~0 with expandable_segments:True.
# --fit keeps the upper end free.
ALLOCATOR_SLACK = (0.02, 0.32)
# What the estimate counts is the bytes the tensors ask for (requested_bytes.all.peak in
# torch.cuda.memory_stats()); max_memory_allocated counts the allocator's blocks: each request
# rounded up to 512 B, and a cached block given whole when less than 1 MiB of it would be left
# (CUDACachingAllocator.cpp should_split; fresh segments over 10 MiB are 2 MiB multiples). On the
# H100, Mistral-300m (vocab 32000): the estimate equal to the requested peak within 0.4 MiB, and
# max_memory_allocated 1.7% above it (69 MiB in fp32, 40.5 MiB in bf16; 47 MiB of it in the
# parameters' and optimizer state's blocks); the H200's batch-1 rows up to 3.3%, the H100's
# llama-mha-300m batch-1 rows (fp32, 4.35 and 3.09 GiB) 4.1% and 4.2%; rows over 10 GiB < 1%. It
# is per block (< 1 MiB each), so small runs with many tensors see the most.
ALLOCATOR_ROUNDING = (0.0, 0.05)
# The estimate's own accuracy against the requested peak (every measured row within 0.06%; the
# target is 0.5%): the low end of max_memory_allocated's range, which cannot be under the requested
# peak but can be under an estimate that is a little over it (two H100 rows, by 0.02%).
ESTIMATE_TOLERANCE = 0.005
# cuBLAS workspaces inside torch's allocator (aten/src/ATen/cuda/CublasHandlePool.cpp): one per
# (handle, stream), allocated on first use through CUDACachingAllocator and kept for the process's
# life (cublas_handle_stream_to_workspace). Handles are per thread (a thread_local PoolWindow), and
# a training step runs matmuls on two threads: the forward (and the optimizer) on the caller's,
# the backward on autograd's device thread (torch/csrc/autograd/engine.cpp, one thread per CUDA
# device). getChosenWorkspaceSize(): 4096 x 8 KiB = 32 MiB on sm90 (H100/H200), 4096 x 2 KiB +
# 16 x 8 KiB elsewhere; CUBLAS_WORKSPACE_CONFIG overrides it. On the H200 rows of
# benchmarks/estimate_accuracy.md every row was 20-40 MiB under with one workspace counted.
CUBLAS_WORKSPACE_SM90 = 32 * 2**20
CUBLAS_HANDLES_PER_STEP = 2
TRACE_SLACK = 64 * 1024   # bytes: what --measure's traced step may hold above the modelled moments unnoticed
DEFAULT_WORKSPACE_BYTES = CUBLAS_HANDLES_PER_STEP * CUBLAS_WORKSPACE_SM90
ALLOCATOR_SLACK_CHECKPOINTING = (0.02, 0.35)


# How far the blog's activation heuristic (all --params alone can use) is from the formula's
# activations + logits, by model size: the range over the fixture configs of tests/fixtures/configs
# at batch x seq of 1x128, 8x512, 4x2048, 16x256 in fp32 and bf16 (recomputed by
# tests/estimate/test_issue34.py::test_params_heuristic_bounds_cover_the_fixture_configs). It is
# an upper bound, and a loose one for small models: its intercept (1.85e6 values a token) is
# there whatever the model (issue 34: 0.5M parameters, batch 8, seq 32: ~570x).
PARAMS_HEURISTIC_RATIO = ((1e9, 0.99, 4.2), (1e8, 1.1, 8.5), (0, 5.5, 570.0))


def heuristic_ratio(n_params: int) -> tuple[float, float]:
    """(low, high): how many times the real activations the heuristic was, for models of this size."""
    for floor, lo, hi in PARAMS_HEURISTIC_RATIO:
        if n_params >= floor:
            return lo, hi
    return PARAMS_HEURISTIC_RATIO[-1][1:]


def allocator_cache_fraction(checkpointing: bool) -> tuple[float, float]:
    """(low, high) fraction of the allocated peak the allocator keeps cached (reserved - allocated)."""
    return ALLOCATOR_SLACK_CHECKPOINTING if checkpointing else ALLOCATOR_SLACK


class EstimateError(ValueError):
    """Inputs that make no estimate (one clear line)."""


@dataclass
class Setup:
    """Everything the estimate depends on. Either arch (from a config) or n_params is given."""
    batch: int = 1
    seq: int = 512
    dtype: str = "fp32"                 # compute dtype: fp32 | bf16 | fp16
    amp: bool = False                   # autocast to dtype with fp32 master weights
    optimizer: str = "adamw"
    impl: str | None = None             # foreach | fused | for-loop; None: what torch picks on `device`
    device: str = "cuda"                # where the step runs: the optimizer's default implementation, CUDA's kernels' own tensors
    state_dtype: str | None = None      # optimizer state dtype (default: the parameters' dtype)
    weight_decay: bool | None = None    # None: the optimizer's torch default (AdamW 0.01; Adam, SGD, Adafactor 0)
    arch: Arch | None = None
    n_params: int | None = None         # without arch
    largest_param: int | None = None    # without arch: elements of the largest tensor (for-loop temps)
    trainable_params: int | None = None  # frozen parameters: only this many train
    freeze_embeddings: bool = False
    lora_rank: int = 0
    lora_targets: tuple[str, ...] = ("q_proj", "v_proj")
    checkpointing: bool = False
    attn: str = "sdpa"
    loss: str = "ce"
    grads_in_forward: bool = False      # gradients live during forward (accumulation, set_to_none=False)
    activations: str = "auto"           # auto | analytical | heuristic | measured
    measured: dict | None = None        # from measure.measure_activations()
    workspace_bytes: int = DEFAULT_WORKSPACE_BYTES   # cuBLAS workspaces in torch's allocator: forward + backward thread, sm90
    shards: int = 1
    zero_stage: int = 0                 # 0 none, 1 optimizer state, 2 + gradients, 3 + parameters (FSDP)

    @property
    def param_bytes(self) -> int:
        if self.amp:
            return 4
        try:
            return DTYPE_BYTES[self.dtype]
        except KeyError:
            raise EstimateError(f"unknown dtype {self.dtype!r} (fp32, bf16, fp16)") from None

    @property
    def precision(self) -> str:
        if self.amp:
            return "amp"
        return "fp32" if self.param_bytes == 4 else "half"


@dataclass
class Term:
    key: str
    label: str
    bytes: int
    at_peak: int           # bytes of this term live at the peak moment
    note: str = ""


@dataclass
class Estimate:
    setup: dict
    n_params: int
    n_trainable: int
    terms: list[Term]
    peak_bytes: int
    peak_phase: str        # "forward/backward" | "optimizer step"
    peak_moment: str       # finer: "end of forward", "start of backward", ...
    phases: dict[str, int]  # high-water mark of each phase
    formula: str
    assumptions: list[str]
    nvml_range: tuple[int, int]
    activation_method: str
    blog: dict = field(default_factory=dict)
    # In the phases the live agent measures (gpumon/agent/phases.py): each phase's high-water mark
    # and the persistent roles at the phase's end, the way the agent reads them:
    # {"forward"|"backward"|"optimizer": {"peak", "parameters", "gradients", "optimizer_state"}}
    live_phases: dict = field(default_factory=dict)
    allocator_cache: tuple[float, float] = ALLOCATOR_SLACK   # the fractions in nvml_range
    allocated_range: tuple[int, int] = (0, 0)   # max_memory_allocated: the peak + the allocator's rounding
    n_no_grad: int = 0     # parameters the step never runs (no gradient, no optimizer state)

    def term(self, key: str) -> Term:
        for t in self.terms:
            if t.key == key:
                return t
        raise KeyError(key)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["peak_gib"] = round(self.peak_bytes / GiB, 3)
        d["predicts"] = ("the bytes requested at a steady-state training step's peak (requested_bytes.all.peak); "
                         "torch.cuda.max_memory_allocated() adds the allocator's block rounding: allocated_range")
        return d


def _trainable_shapes(s: Setup, arch: Arch | None, meas: dict | None, n_train: int, n: int):
    """The trainable parameters' shapes (what shape-dependent optimizer state is computed from), or
    None where they are not known (--params alone; --trainable N, which does not say which)."""
    if meas:
        shapes = meas.get("param_shapes")
        return [tuple(x) for x in shapes] if shapes is not None and s.trainable_params is None else None
    if not arch or s.trainable_params is not None:
        return None
    if s.lora_rank:      # each adapter: lora_A [r, in], lora_B [out, r]
        out = []
        for name, a, b, _ in arch.linears():
            if any(name == t or name.endswith("." + t) or t == "all" for t in s.lora_targets):
                out += [(s.lora_rank, a), (b, s.lora_rank)]
        return out * arch.layers
    shapes = arch.param_shapes(trained_only=True)
    if s.freeze_embeddings:     # the embedding (and a tied head, the same tensor) does not train
        shapes = shapes[1:]
    return shapes


def estimate(s: Setup) -> Estimate:
    if s.batch < 1 or s.seq < 1:
        raise EstimateError("batch and sequence length must be >= 1")
    pb = s.param_bytes
    cb = DTYPE_BYTES.get(s.dtype)
    if cb is None:
        raise EstimateError(f"unknown dtype {s.dtype!r} (fp32, bf16, fp16)")
    sb = DTYPE_BYTES[s.state_dtype] if s.state_dtype else pb
    if s.shards < 1 or s.zero_stage not in (0, 1, 2, 3):
        raise EstimateError("--shards must be >= 1 and --zero one of 0, 1, 2, 3")
    if s.shards > 1 and not s.zero_stage:
        raise EstimateError(f"--shards {s.shards} without --zero: say which ZeRO stage shards the model states "
                            "(--zero 1 optimizer state, 2 + gradients, 3 + parameters)")
    if s.zero_stage and s.shards < 2:
        raise EstimateError(f"--zero {s.zero_stage} without --shards N: say over how many ranks (N >= 2)")
    arch = s.arch
    meas = s.measured
    if arch and s.seq > arch.max_positions:
        raise EstimateError(f"sequence length {s.seq} is past the config's max_position_embeddings "
                            f"({arch.max_positions}): the model cannot run it as configured")
    assumptions: list[str] = []
    try:
        if s.impl:
            impl, impl_why = s.impl, "given"
        else:
            impl, impl_why = default_impl(s.optimizer, s.device)
        check_impl(s.optimizer, impl)
    except ValueError as e:
        raise EstimateError(str(e)) from None

    # --- parameter counts ------------------------------------------------------------------
    idle = 0    # parameters the step never runs: no gradient, no optimizer state (torch.optim skips them)
    if meas:
        n = meas["n_params"]
        idle = meas.get("n_no_grad", 0)
        largest = meas["largest_param"]
        n_train = meas["n_trainable"]
        largest_train = meas.get("largest_trainable", largest)
        head_numel = meas.get("head_numel", 0)
        tied = meas.get("tied", False)
    elif arch:
        n = arch.param_count()
        idle = arch.idle_params()
        largest = arch.largest_param()
        head_numel = arch.vocab * arch.hidden
        tied = arch.tie_embeddings
        if s.lora_rank:
            n_lora = arch.lora_params(s.lora_rank, s.lora_targets)
            n += n_lora
            n_train = n_lora
            largest_train = max(s.lora_rank * max(a, b) for _, a, b, _ in arch.linears())
        else:
            n_train = n - idle - (arch.embedding_params() if s.freeze_embeddings else 0)
            largest_train = largest
    elif s.n_params:
        n = s.n_params
        largest = s.largest_param or 0
        n_train = n
        largest_train = largest
        head_numel, tied = 0, False
        if not s.largest_param and impl == "for-loop":
            assumptions.append("largest parameter unknown (give --config): for-loop step temporaries taken as 0")
    else:
        raise EstimateError("give --params, --config or --model")
    if s.trainable_params is not None:
        n_train = min(n - idle, s.trainable_params)
        largest_train = min(largest_train, n_train)
    frozen = n_train < n - idle
    if idle and not meas:
        assumptions.append(f"add_cross_attention: the {idle:,} cross-attention parameters run only with "
                           "encoder_hidden_states, which a language-model step does not pass: no gradient and no "
                           "optimizer state counted for them (torch.optim skips a parameter whose .grad is None)")
    if s.trainable_params is not None and not s.lora_rank:
        assumptions.append("--trainable: activations counted as if every layer trains (which parameters are "
                           "frozen is not known); frozen layers save less")
    head_trainable = not frozen or (not s.lora_rank and not s.freeze_embeddings and s.trainable_params is None)

    P = n * pb
    G = n_train * pb
    shapes = _trainable_shapes(s, arch, meas, n_train, n)
    if shapes is None and s.trainable_params is not None and s.optimizer.lower() in ("adafactor", "adamw8bit"):
        raise EstimateError(f"--trainable with {s.optimizer}: its state depends on which tensors train (their "
                            "shapes); use --freeze-embeddings or --lora-rank, which say which")
    wd = s.weight_decay if s.weight_decay is not None else s.optimizer.lower() in ("adamw", "adamw8bit", "lion")
    ordered = arch.param_numels(trained_only=True) if arch and not meas and not frozen else None
    try:
        oc = optimizer_cost(s.optimizer, impl, n_train, largest_train, sb, wd, None, ordered, shapes)
    except ValueError as e:
        raise EstimateError(str(e)) from None
    O, opt_temp = oc.state_bytes, oc.temp_bytes

    # --- sharding (ZeRO / FSDP), a stated approximation ----------------------------------------
    gathered = 0
    if s.shards > 1 and s.zero_stage:
        k = s.shards
        O //= k
        opt_temp //= k if impl == "foreach" else 1
        if s.zero_stage >= 2:
            G //= k
        if s.zero_stage >= 3:
            P //= k
            if arch:
                # FSDP gathers a layer's full parameters (and prefetches the next); the root unit
                # (embedding, positions, final norm, output head) is gathered for the whole step.
                root = arch.embedding_params() + arch.position_params() + arch.norm_params() + arch.head_params()
                gathered = (2 * arch.layer_params() + root) * pb
            else:
                raise EstimateError("--zero 3 needs --config: the gathered layer and root parameters depend on "
                                    "the layer shapes")
        assumptions.append(f"ZeRO-{s.zero_stage} over {k} ranks: model states divided by {k} (approximation: "
                           "communication buckets and gathered layers are approximated)")

    # --- activations -----------------------------------------------------------------------
    method = s.activations
    if method == "auto":
        method = "measured" if meas else ("analytical" if arch else "heuristic")
    act_bytes_heur = blog_heuristic_bytes(n, s.batch, s.seq, cb)
    if method == "measured":
        if not meas:
            raise EstimateError("activations=measured needs a measurement (--measure)")
        am = _measured_model(meas, s)
    elif method == "analytical":
        if not arch:
            raise EstimateError("the analytical activation formula needs --config (or use --measure)")
        am = transformer_activations(arch, s.batch, s.seq, s.precision, s.attn, s.checkpointing, s.loss,
                                     # only LoRA says the layers are frozen; --trainable N does not say which
                                     trainable_linears=not s.lora_rank,
                                     lora_targets=s.lora_targets if s.lora_rank else (), lora_rank=s.lora_rank,
                                     cuda=s.device != "cpu")
    elif method == "heuristic":
        am = ActivationModel(method="heuristic", layers=1, per_layer=act_bytes_heur, per_layer_weight_copies=0,
                             per_layer_stored=act_bytes_heur, final=0, head_saved=0, head_fwd_extra=0,
                             head_bwd_pre=0, head_bwd_lm=0, layer_bwd_transient=0, attention="n/a",
                             notes=[heuristic_note(n)])
        if s.checkpointing:
            assumptions.append("checkpointing is ignored by the blog's heuristic")
    else:
        raise EstimateError(f"unknown activation method {method!r}")

    # --- phases ----------------------------------------------------------------------------
    G_head = head_numel * pb if head_trainable else 0
    if meas or not arch:
        G_layer = max(0, G - G_head)
        L = 1
        layer_grads = [G_layer]
    else:
        L = arch.layers
        G_layer = arch.layer_trained_params() * pb if not frozen else max(0, G - G_head) // L
        # each layer's own gradients, where MoE and dense layers differ (DeepSeek's first layers are
        # dense: counting them as MoE layers put V2-Lite's backward 3% high)
        layer_grads = ([arch._block_params(arch._is_moe_layer(j)) * pb for j in range(L)]
                       if not frozen and arch.experts and arch.moe_layers != L else [G_layer] * L)
        if s.zero_stage >= 2 and s.shards > 1:
            G_layer //= s.shards
            layer_grads = [g // s.shards for g in layer_grads]
            G_head //= s.shards
    G_fwd = G if s.grads_in_forward else 0
    W = s.workspace_bytes
    base = P + O + gathered + W
    moments: list[tuple[int, str]] = []
    if method == "heuristic" or am.layers != L:
        live_l, stored_l, trans_l = [am.per_layer_stored] * L, [am.per_layer_stored] * L, [am.layer_bwd_transient] * L
    else:
        live_l, stored_l, trans_l = am.layer_lists()
    stored_all = sum(stored_l)
    fwd_end = base + G_fwd + stored_all + am.final + am.head_saved + am.head_fwd_extra
    moments.append((fwd_end, "end of forward (all activations + logits)"))
    layer_fwd = max(((base + G_fwd + sum(stored_l[:j]) + peak, j) for j, peak in enumerate(am.layer_fwd_peaks)
                     if peak and len(am.layer_fwd_peaks) == L and method == "analytical"), default=None)
    if layer_fwd and layer_fwd[0] > fwd_end:     # an MoE layer's routed output, above the end of forward
        moments[0] = (layer_fwd[0], f"forward of layer {layer_fwd[1] + 1} (its experts' routed output)")
    bwd_start = base + G_fwd + stored_all + am.final + max(am.head_bwd_pre, am.head_bwd_lm + G_head)
    moments.append((bwd_start, "start of backward (loss and logits gradients)"))
    grads = G_fwd if G_fwd else G_head
    for k in range(L, 0, -1):
        below = sum(stored_l[:k - 1])
        start = base + grads + below + live_l[k - 1] + trans_l[k - 1]
        moments.append((start, f"backward of layer {k}" if L > 1 else "backward"))
        if not G_fwd:
            grads += layer_grads[k - 1]
        end = base + grads + below
        moments.append((end, f"backward of layer {k}" if L > 1 else "backward"))
    # The embedding's backward makes a dense V x h gradient. Untied, it becomes .grad (no extra).
    # Tied, autograd's input buffer sums it with lm_head's gradient before AccumulateGrad: lm_head's
    # is a transposed mm output, so the sum is out of place (aten::add, seen in the profiler): old +
    # new + sum = 2 x V x h on top of the gradients. Under autocast lm_head's gradient comes out of
    # the cast's backward, contiguous and unshared, and is summed in place: 1 x V x h. With
    # gradients kept from an earlier micro-step (accumulation) the buffered lm_head gradient is not
    # part of .grad, so it counts too: 3 x V x h (autocast: 2). Untied and accumulating into an
    # existing .grad (+=, in place): the new gradient only, 1 x V x h.
    # (All measured on CPU, tests/estimate/test_cpu_peak.py.)
    emb_extra = 0
    if head_trainable and tied:
        emb_extra = ((1 if s.amp else 2) + (1 if G_fwd else 0)) * head_numel * pb
    elif head_trainable and G_fwd:
        emb_extra = head_numel * pb
    if s.zero_stage >= 2 and s.shards > 1:
        emb_extra //= s.shards
    bwd_end = base + max(G, grads) + emb_extra
    moments.append((bwd_end, "end of backward (all gradients)"))
    # --measure also traced the step itself on fake tensors (every storage the ops made, until it
    # died): its own high-water marks hold what the saved bytes cannot (a block's backward
    # transients). Its loss was the output's mean, so the head's moments above still stand for
    # cross-entropy. Gradients weigh as this run holds them: sharded, or whole from the start
    # when kept from a micro-step before (then the traced ones were added in place).
    traced_fwd, traced_bwd, traced_bwd_grads = 0, 0, 0
    if method == "measured" and meas.get("trace"):
        fwd_bytes, front = meas["trace"]
        traced_fwd = base + G_fwd + fwd_bytes
        g_scale = G / (n_train * pb) if n_train else 0
        traced_bwd, traced_bwd_grads = max(
            ((base + other + g_live, g_live) for other, g_live in
             ((o, G_fwd or int(g * g_scale)) for o, g in front)), default=(0, 0))
    fb_peak, fb_moment = max(moments, key=lambda m: m[0])
    # a traced moment is the peak only where it holds more than the model's moments beyond the
    # loss's scalars (a few bytes the model leaves out): the model's moment names the place
    if traced_bwd > fb_peak + TRACE_SLACK:
        moments.append((traced_bwd, "backward (traced on fake tensors)"))
        fb_peak, fb_moment = moments[-1]
    if traced_fwd > fb_peak + TRACE_SLACK:
        fb_peak, fb_moment = traced_fwd, "forward (traced on fake tensors)"
    opt_peak = P + O + G + opt_temp + gathered + W
    if opt_peak > fb_peak:
        peak, phase, moment = opt_peak, "optimizer step", "optimizer step (gradients + step temporaries)"
    else:
        peak, phase, moment = fb_peak, "forward/backward", fb_moment

    # --- terms, and what of each is live at the peak ----------------------------------------
    in_opt = phase == "optimizer step"
    acts_total = stored_all + am.final + am.head_saved
    copies = L * am.per_layer_weight_copies if not s.checkpointing else 0
    rest = fb_peak - base
    # split what is above params + state at the forward/backward high-water mark
    if fb_moment.startswith("end of backward"):
        g_at = min(rest, max(G, grads))
    elif fb_moment.startswith(("end of forward", "forward (traced", "forward of layer")):
        g_at = G_fwd
    elif fb_moment.startswith("backward (traced"):
        g_at = traced_bwd_grads
    elif fb_moment.startswith("start of backward"):
        g_at = G_fwd + (G_head if am.head_bwd_lm + G_head >= am.head_bwd_pre else 0)
    else:
        g_at = min(rest, _grads_at(moments, fb_peak, G_fwd, G_head, layer_grads))
    fb_at = {"params": P, "grads": g_at, "opt_state": O, "opt_temp": 0,
             "activations": max(0, rest - g_at), "workspace": W}
    opt_at = {"params": P, "grads": G, "opt_state": O, "opt_temp": opt_temp, "workspace": W}
    at = opt_at if in_opt else fb_at
    # The agent's phases: forward runs to the start of the autograd pass (loss included), backward
    # is the pass, optimizer is step(). It reads parameters/gradients/state at each phase's end.
    fwd_peak = max(moments[0][0], traced_fwd)
    bwd_peak = max(m[0] for m in moments[1:])      # moments[0] is the end of forward
    live_phases = {
        "forward": {"peak": fwd_peak, "parameters": P + gathered, "gradients": G_fwd, "optimizer_state": O},
        "backward": {"peak": bwd_peak, "parameters": P + gathered, "gradients": max(G, grads), "optimizer_state": O},
        "optimizer": {"peak": opt_peak, "parameters": P + gathered, "gradients": G, "optimizer_state": O},
    }
    terms = [
        Term("params", "parameters", P, at.get("params", 0),
             f"{n:,} x {pb} B" + (" (fp32 master weights)" if s.amp else "")),
        Term("grads", "gradients", G, at.get("grads", 0), f"{n_train:,} trainable x {pb} B"
             + (f"; {idle:,} parameters a step never runs get no gradient and no optimizer state"
                if idle else "")),
        Term("opt_state", "optimizer state", O, at.get("opt_state", 0), f"{s.optimizer} ({impl}): {oc.state_desc}"),
        Term("opt_temp", "optimizer step temporaries", opt_temp, at.get("opt_temp", 0), oc.temp_desc),
        Term("activations", "activations (saved for backward)", acts_total - copies,
             0, f"{am.method}" + (f", attention: {am.attention}" if am.attention not in ("", "n/a") else "")),
    ]
    if copies:
        terms.append(Term("weight_copies", "autocast 16-bit weight copies", copies, 0, "saved by each matmul"))
    terms.append(Term("logits", "logits and loss transients", max(am.head_fwd_extra, am.head_bwd_peak - am.head_saved),
                      0, f"tokens x vocab ({s.loss} loss)"))
    if W:
        terms.append(Term("workspace", "cuBLAS workspaces", W, W,
                          "inside torch's allocator: one per thread running matmuls (forward, autograd's "
                          "backward thread), 32 MiB each on H100/H200; --workspace sets the total, 0 drops it"))
    if gathered:
        terms.append(Term("gathered", "FSDP gathered parameters", gathered, gathered,
                          "2 layers + the root unit (embedding, final norm, output head)"))
    # what of the activations side is live at the peak: saved activations, weight copies, logits
    if not in_opt:
        head_moment = fb_moment.startswith(("end of forward", "start of backward"))
        logits_at = 0
        if fb_moment.startswith("end of forward"):
            logits_at = am.head_fwd_extra
        elif fb_moment.startswith("start of backward"):
            logits_at = fb_peak - base - G_fwd - stored_all - am.final - am.head_saved - (
                G_head if am.head_bwd_lm + G_head >= am.head_bwd_pre else 0)
        copies_at = copies if head_moment else 0
        for t in terms:
            if t.key == "activations":
                t.at_peak = max(0, at["activations"] - logits_at - copies_at)
            elif t.key == "logits":
                t.at_peak = logits_at
            elif t.key == "weight_copies":
                t.at_peak = copies_at
    assumptions.append(f"optimizer implementation: {impl} " + ("(given)" if impl_why == "given" else f"= {impl_why}"))
    cache = allocator_cache_fraction(s.checkpointing)
    formula = ("peak = parameters + optimizer state + max(gradients + optimizer step temporaries, "
               "forward/backward high-water mark [saved activations + logits/loss + the gradients "
               "already computed at that moment])")
    assumptions += [
        "predicts the bytes the tensors request at a steady-state step's peak (step >= 2: optimizer state "
        "exists); torch.cuda.max_memory_allocated() adds the allocator's block rounding, "
        f"{ALLOCATOR_ROUNDING[0]*100:.0f}-{ALLOCATOR_ROUNDING[1]*100:.0f}% measured (most runs < 1%)",
        "zero_grad(set_to_none=True): no gradients during forward" if not s.grads_in_forward
        else "gradients live during forward (accumulation / set_to_none=False)",
        f"NVML/nvidia-smi shows more: + CUDA context and workspaces ~{CUDA_CONTEXT_BYTES[0]/GiB:.1f}-"
        f"{CUDA_CONTEXT_BYTES[1]/GiB:.2f} GiB (outside torch's figures), + allocator cache "
        f"{cache[0]*100:.0f}-{cache[1]*100:.0f}% of the peak (reserved - allocated; "
        "less with expandable_segments:True)",
    ]
    if meas and not meas.get("output_numel"):
        assumptions.append("loss: the mean of the model's output (it has no output embedding, so no "
                           "language-model cross-entropy over logits is counted; --loss does not apply)")
    elif s.loss == "ce":
        assumptions.append("loss: cross-entropy over the full logits (HF labels= path); the outputs object is "
                           "not kept alive across backward")
    assumptions += am.notes
    allocated = (int(peak * (1 + ALLOCATOR_ROUNDING[0] - ESTIMATE_TOLERANCE)),
                 int(peak * (1 + ALLOCATOR_ROUNDING[1])))
    nvml = (int(allocated[0] * (1 + cache[0]) + CUDA_CONTEXT_BYTES[0]),
            int(allocated[1] * (1 + cache[1]) + CUDA_CONTEXT_BYTES[1]))
    blog_opt = P + O + G + n_train * pb
    blog = {"activations_bytes": act_bytes_heur,
            "activations_per_token": BLOG_A_SLOPE * n + BLOG_A_INTERCEPT,
            "total_bytes": P + O + max(G + n_train * pb, act_bytes_heur),
            "optimizer_branch_bytes": blog_opt}
    setup = {k: v for k, v in asdict(s).items() if k not in ("arch", "measured")}
    setup["impl"] = impl
    setup["impl_source"] = impl_why
    if arch:
        setup["arch"] = arch.to_dict()
    return Estimate(setup=setup, n_params=n, n_trainable=n_train, terms=terms, peak_bytes=peak,
                    peak_phase=phase, peak_moment=moment,
                    phases={"forward/backward": fb_peak, "optimizer step": opt_peak},
                    formula=formula, assumptions=assumptions, nvml_range=nvml,
                    activation_method=am.method, blog=blog, live_phases=live_phases,
                    allocator_cache=cache, allocated_range=allocated, n_no_grad=idle)


def heuristic_note(n: int) -> str:
    lo, hi = heuristic_ratio(n)
    size = "1B+" if n >= 1e9 else ("100M-1B" if n >= 1e8 else "under-100M")
    return (f"--params alone: a rough upper bound. Activations are the blog's heuristic A = 4.6894e-4 x N + "
            f"1.8494e6 values a token, which on the configs tested was {lo:g}x to {hi:g}x the real activations "
            f"and logits for {size} models; give --config (or --measure) for the formula")


def _grads_at(moments, value, G_fwd, G_head, layer_grads) -> int:
    """Gradient bytes at the backward moment whose live bytes are `value` (replays the loop order)."""
    if G_fwd:
        return G_fwd
    grads = G_head
    idx = 0
    for k in range(len(layer_grads), 0, -1):
        if moments[2 + idx][0] == value:
            return grads
        grads += layer_grads[k - 1]
        if moments[3 + idx][0] == value:
            return grads
        idx += 2
    return grads


def _measured_model(meas: dict, s: Setup) -> ActivationModel:
    """Activations from a --measure run: exact saved bytes; the head transients from the output shape."""
    out = meas.get("output_bytes", 0)
    V_tokens = meas.get("output_numel", 0)
    hidden = meas.get("head_input_bytes", 0)
    head_pre, head_lm = out, out + hidden
    if s.loss == "ce" and V_tokens:
        head_pre = max(12 * V_tokens, (4 * V_tokens + out) if out != 4 * V_tokens else 0)
    notes = ["activations measured: bytes autograd saved in forward (saved-tensor hooks, deduplicated by storage)"]
    notes += meas.get("notes", [])
    return ActivationModel(method="measured", layers=1, per_layer=meas["saved_bytes"], per_layer_weight_copies=0,
                           per_layer_stored=meas["saved_bytes"], final=0,
                           head_saved=4 * V_tokens if s.loss == "ce" and V_tokens else 0,
                           head_fwd_extra=out + (4 * V_tokens if s.loss == "ce" and out != 4 * V_tokens else 0),
                           head_bwd_pre=head_pre, head_bwd_lm=head_lm, layer_bwd_transient=0, attention=meas.get("attention", ""),
                           notes=notes)
