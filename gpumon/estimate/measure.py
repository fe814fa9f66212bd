"""`--measure`: build the model without memory (fake tensors) and count what autograd saves.

The model runs one forward under `torch.autograd.graph.saved_tensors_hooks`; every tensor autograd
packs is recorded by its storage (views share one), parameters and buffers are left out, and
the bytes of the distinct storages are what the forward leaves for backward: exact for the ops
that run, with no GPU and no memory used. Backward then runs once (the output's mean as the loss),
and the whole step is traced by a dispatch mode that follows every storage the ops make until it
dies: the step's own high-water marks, transients included (_live_bytes_mode, step_front).

The model is built and run under torch's FakeTensorMode (tensors with shapes, dtypes and storages
but no data; `device="meta"` is the alternative, which cannot run code that enters
`torch.autocast(...)` on its tensors' device, as Hugging Face's rotary embedding does).

Attention: without a GPU `scaled_dot_product_attention` would run a CPU or math kernel. On a GPU,
sdpa dispatches to flash or memory-efficient attention when it can, and those save different
tensors (q, k, v, the output and a log-sum-exp instead of the L x L probabilities). So during the
measurement sdpa is routed the way CUDA routes it (activations.resolve_attention's rules) and
flash / efficient are emulated by an autograd Function that saves exactly what those kernels save.
(Left alone, torch on fake CPU tensors would pick its CPU kernels, sdp_utils_cpp.cpp: flash, then
math.) A mask passed to sdpa is counted as the math kernel (B x H x L x L probabilities) and said.
Hugging Face's mask code would pass one on fake tensors where a GPU run passes none: see
_OneSequencePerRow.

torch is imported inside the functions (importlib), never at module import: gpumon.estimate must
stay importable without torch.
"""
from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import sys
import warnings
import weakref
from typing import Any, Callable


class MeasureError(RuntimeError):
    """The model could not be measured (one clear line, with what to do instead)."""


DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def _torch():
    try:
        with warnings.catch_warnings():      # e.g. "Failed to initialize NumPy" at import
            warnings.simplefilter("ignore")
            return importlib.import_module("torch")
    except ImportError:
        raise MeasureError("--measure needs torch installed here (pip install torch); "
                           "without it use --config for the analytical formula") from None


def _find_spec(name: str):
    try:
        return importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None


def preflight(model: str | None = None, config: str | None = None) -> None:
    """The errors that need no torch, found in milliseconds rather than after seconds of imports:
    a --model that is not pkg.module:factory or whose top-level package is not importable, and a
    missing torch or transformers."""
    if model is not None:
        if ":" not in model or not all(model.partition(":")[::2]):
            raise MeasureError(f"--model wants pkg.module:factory, got {model!r}")
        top = model.partition(":")[0].split(".")[0]
        if "" not in sys.path and "." not in sys.path:
            sys.path.insert(0, "")
        if _find_spec(top) is None:
            raise MeasureError(f"cannot import {model.partition(':')[0]!r}: no module named {top!r} "
                               "(run from the folder that holds it, or set PYTHONPATH)")
        mod_name, _, attr = model.partition(":")
        try:        # a submodule: find_spec imports its parent packages only (not torch, unless they do)
            spec = importlib.util.find_spec(mod_name)
        except ImportError as e:
            raise MeasureError(f"cannot import {mod_name!r}: {type(e).__name__}: {e}") from None
        except Exception:   # the user's package raised while imported: load_factory reports it
            spec = False
        if spec is None:
            raise MeasureError(f"cannot import {mod_name!r}: no module named {mod_name!r}")
        names = _top_level_names(spec.origin) if spec else None
        if names is not None and attr.split(".")[0] not in names:
            raise MeasureError(f"{mod_name} has no {attr.split('.')[0]!r} (defined there: "
                               f"{', '.join(sorted(n for n in names if not n.startswith('_'))[:8]) or 'nothing'})")
    if _find_spec("torch") is None:
        raise MeasureError("--measure needs torch installed here (pip install torch); "
                           "without it use --config for the analytical formula")
    if config is not None and _find_spec("transformers") is None:
        raise MeasureError("--measure with --config needs transformers installed (pip install transformers); "
                           "without it the analytical formula is used when --measure is left out")


def _top_level_names(path: str | None) -> set[str] | None:
    """The names a Python file binds at its top level (def, class, assignment, import), read with ast
    (no import, so no torch): None when they cannot be told (not a .py file, a syntax error left to
    the import to report, a star import or a module __getattr__)."""
    import ast
    if not path or not path.endswith(".py"):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
    except (OSError, SyntaxError, ValueError, UnicodeDecodeError):
        return None
    names: set[str] = set()

    def targets(t):
        if isinstance(t, ast.Name):
            names.add(t.id)
        elif isinstance(t, (ast.Tuple, ast.List)):
            for x in t.elts:
                targets(x)
        elif isinstance(t, ast.Starred):
            targets(t.value)

    def walk(body) -> bool:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Assign):
                for t in node.targets:
                    targets(t)
            elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
                targets(node.target)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                for a in node.names:
                    if a.name == "*":
                        return False
                    names.add(a.asname or a.name.split(".")[0])
            elif isinstance(node, (ast.If, ast.Try, ast.With, ast.For, ast.While)):
                for part in ("body", "orelse", "finalbody"):
                    if not walk(getattr(node, part, None) or []):
                        return False
                for h in getattr(node, "handlers", None) or []:
                    if not walk(h.body):
                        return False
            elif hasattr(ast, "TypeAlias") and isinstance(node, ast.TypeAlias):
                targets(node.name)
        return True

    if not walk(tree.body) or "__getattr__" in names:
        return None
    return names


def load_factory(spec: str) -> Callable[..., Any]:
    """'pkg.mod:factory' -> the callable (the current directory is importable, like python -m)."""
    if ":" not in spec:
        raise MeasureError(f"--model wants pkg.module:factory, got {spec!r}")
    mod_name, _, attr = spec.partition(":")
    if "" not in sys.path and "." not in sys.path:
        sys.path.insert(0, "")
    try:
        mod = importlib.import_module(mod_name)
    except Exception as e:  # the user's module: any error is theirs, reported in one line
        raise MeasureError(f"cannot import {mod_name!r}: {type(e).__name__}: {e}") from None
    fn = mod
    for part in attr.split("."):
        fn = getattr(fn, part, None)
        if fn is None:
            raise MeasureError(f"{mod_name} has no {attr!r}")
    if not callable(fn):
        raise MeasureError(f"{spec} is not callable")
    return fn


def _sdpa_router(torch, original, forced: str | None = None):
    """Replacement for F.scaled_dot_product_attention that saves what the CUDA kernel would.

    The kernel is the one CUDA's sdpa picks (torch/csrc/.../sdp_utils.cpp, sm80+): flash for
    fp16/bf16 with head_dim <= 256 and no mask; in 16 bits with q/k and v head dims flash cannot
    take (MLA: 192 and 128) cuDNN's kernel, which torch prefers on sm90 (activations.resolve_attention);
    the memory-efficient kernel otherwise (it takes fp32 and arbitrary masks, not grouped-query
    attention); else math. `forced` (--attn flash, efficient or math) overrides the choice.
    """

    fake_cls = getattr(importlib.import_module("torch._subclasses.fake_tensor"), "FakeTensor", ())

    def is_fake(t) -> bool:
        return isinstance(t, fake_cls)

    class _FusedAttention(torch.autograd.Function):
        # flash / memory-efficient: save q, k, v, out, logsumexp (and the mask as a bias of q's
        # dtype: a boolean mask is converted on every call). Both kernels run on q transposed to
        # [B, L, H, D] and return their output transposed back. The output's layout matters to
        # what the caller saves next (a .contiguous() of it is a copy or not):
        # - flash (flash_attn/flash_api.cpp mha_fwd): out = at::empty_like(q), q's own layout
        #   (nn.MultiheadAttention's q is a view of its packed in_proj output laid out
        #   [L, B, H, D], so its permute(2, 0, 1, 3).contiguous() is then no copy); logsumexp
        #   [B, H, L] in fp32;
        # - memory-efficient (attention.cu _efficient_attention_forward): out = at::empty({B, M,
        #   num_heads, Kv}), contiguous [B, L, H, D]; logsumexp [B, H, L rounded up to 32];
        # - cuDNN (cudnn/MHA.cpp): out in q's layout with v's head dim (alloc_with_matching_layout),
        #   softmax stats [B, H, L, 1] in fp32.
        @staticmethod
        def forward(ctx, q, k, v, mask, is_causal, scale, gqa, flash, cudnn=False):
            # On fake tensors the values do not matter, and the CPU op would build the B x H x L x L
            # scores (its math path) that CUDA's fused kernels never hold: in the traced step they
            # were a forward peak of 8 bytes a score the GPU does not have (DeepSeek-V2-Lite, batch
            # 8, seq 2048: +1.1 GB). Real tensors still get the real output.
            fake = is_fake(q)
            out = None
            if not fake:
                with torch.no_grad():
                    out = original(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=gqa)
            B, H, L, D = (*q.shape[:3], v.shape[-1])
            if flash:     # flash takes equal head dims only (the router sees to it): q's layout fits
                out_bl = torch.empty_like(q.transpose(1, 2)).transpose(1, 2)
                lse = torch.empty((B, H, L), dtype=torch.float32, device=q.device)
            elif cudnn:   # q's dimension order, v's head dim
                order = sorted(range(4), key=lambda i: -q.stride(i))
                shape = (B, H, L, D)
                out_bl = torch.empty([shape[i] for i in order], dtype=q.dtype, device=q.device).permute(
                    [order.index(i) for i in range(4)])
                lse = torch.empty((B, H, L, 1), dtype=torch.float32, device=q.device)
            else:         # v's head dim may differ from q's (MLA: 192 vs 128)
                out_bl = torch.empty((B, L, H, D), dtype=q.dtype, device=q.device).transpose(1, 2)
                lse = torch.empty((B, H, -(-L // 32) * 32), dtype=torch.float32, device=q.device)
            if out is not None:
                out_bl.copy_(out)
            saved = [q, k, v, out_bl, lse]
            if mask is not None:
                # sdpa converts a boolean mask to a bias of q's dtype on every call, and pads the
                # bias's last dimension to a multiple of 16 (preprocess_mask / pad_bias): a copy
                # per layer; an aligned float mask is used (and saved) as it is
                Lk = mask.shape[-1]
                if mask.dtype == torch.bool or Lk % 16:
                    padded = torch.empty((*mask.shape[:-1], -(-Lk // 16) * 16), dtype=q.dtype, device=q.device)
                    saved.append(padded[..., :Lk])
                else:
                    saved.append(mask)
            ctx.save_for_backward(*saved)
            return out_bl

        @staticmethod
        def backward(ctx, grad):
            q, k, v = ctx.saved_tensors[:3]
            return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), None, None, None, None, None, None

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        half = query.dtype in (torch.float16, torch.bfloat16)
        grad = torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad)
        gqa_needed = key.shape[-3] != query.shape[-3]
        d = query.shape[-1]
        # sdp_utils.cpp check_head_dim_size_flash: q, k and v of one head dim, a multiple of 8, <= 256
        flash_dims = key.shape[-1] == d and value.shape[-1] == d and d % 8 == 0 and d <= 256
        dv = value.shape[-1]      # cuDNN (sdp_utils.cpp check_cudnn_tensor_shapes): q/k one dim, each a multiple of 8, <= 256
        cudnn_dims = key.shape[-1] == d and d % 8 == 0 and dv % 8 == 0 and d <= 256 and dv <= 256
        if attn_mask is not None:
            sdpa.masked += 1
        if not grad:
            kernel = "math"       # nothing is saved either way
        elif forced:
            kernel = forced
            if kernel == "flash" and not flash_dims:
                raise MeasureError(f"--attn flash: CUDA's flash kernel takes q, k and v of one head dim (a multiple "
                                   f"of 8, at most 256); this model has q {d}, k {key.shape[-1]}, v {value.shape[-1]} "
                                   "(sdpa would run the memory-efficient kernel: --attn efficient)")
        elif half and flash_dims and attn_mask is None:
            kernel = "flash"
        elif half and cudnn_dims and attn_mask is None and not gqa_needed:
            kernel = "cudnn"
        elif gqa_needed:
            kernel = "math"
        else:
            kernel = "efficient"
        if grad:
            sdpa.kernels.add(kernel + (" with a mask" if attn_mask is not None and kernel != "math" else "")
                             + (" and dropout" if dropout_p > 0 else ""))
        if kernel == "math":
            return _cuda_math_attention(torch, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
        # flash / efficient with dropout keep only a philox seed and offset (16 bytes, or CPU scalars):
        # no mask, nothing the size of the scores
        return _FusedAttention.apply(query, key, value, attn_mask if kernel == "efficient" else None,
                                     is_causal, scale, enable_gqa, kernel == "flash", kernel == "cudnn")

    sdpa.kernels = set()
    sdpa.masked = 0
    return sdpa


def _bool_mask_dropout(torch):
    """An autograd Function that saves what CUDA's native_dropout saves: a bool mask (1 byte an
    element). CPU's dropout (Dropout.cpp _dropout_impl) saves its noise in the input's dtype."""
    if getattr(_bool_mask_dropout, "cache", None) is not None:
        return _bool_mask_dropout.cache

    class _Dropout(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(torch.empty(x.shape, dtype=torch.bool, device=x.device))
            return torch.empty_like(x)

        @staticmethod
        def backward(ctx, grad):
            return torch.empty_like(grad)

    _bool_mask_dropout.cache = _Dropout
    return _Dropout


def _cuda_math_attention(torch, q, k, v, mask, dropout_p, is_causal, scale, enable_gqa):
    """sdpa's math kernel (attention.cpp _scaled_dot_product_attention_math) as it runs on CUDA.

    Written out because on fake CPU tensors the op's own dropout takes CPU's path. What it saves
    (checked against the op with saved-tensor hooks, tests/estimate/test_attention_kernels.py):
    fp16/bf16 inputs are upcast to fp32 first (unless allow_fp16_bf16_reduction_math_sdp), so q
    and k, each scaled by sqrt(scale), v (repeated for grouped-query attention) and the softmax
    output are fp32; with dropout, CUDA's native_dropout saves a bool mask and the matmul the
    dropped probabilities (fp32 again): B x H x L x L x (4 + 1 + 4) bytes, not x 4.
    """
    cls = _bool_mask_dropout(torch)
    origin = q.dtype
    upcast = origin in (torch.float16, torch.bfloat16)
    try:
        upcast = upcast and not torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed()
    except AttributeError:
        pass
    if upcast:
        q, k, v = q.float(), k.float(), v.float()
    if enable_gqa and k.shape[-3] != q.shape[-3]:
        rep = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(rep, dim=-3), v.repeat_interleave(rep, dim=-3)
    s = (scale if scale is not None else 1.0 / q.shape[-1] ** 0.5) ** 0.5
    attn = (q * s) @ (k.transpose(-2, -1) * s)
    if is_causal:
        L, S = q.shape[-2], k.shape[-2]
        mask = torch.ones((L, S), dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        if mask.dtype == torch.bool:   # convert_boolean_attn_mask: an additive mask of the inputs' dtype
            mask = torch.zeros(mask.shape, dtype=origin, device=q.device).masked_fill_(~mask, float("-inf"))
        attn.add_(mask)
    attn = torch.softmax(attn, -1)
    if dropout_p > 0:
        attn = cls.apply(attn)
    return (attn @ v).to(origin)


def _grouped_mm_shim(torch, original):
    """torch._grouped_mm for fake tensors of any dtype.

    transformers' default experts implementation calls torch.nn.functional.grouped_mm (or
    torch._grouped_mm); its fake/meta kernel accepts only bf16 (the fast CUDA kernel's rule) while
    the real CPU and CUDA kernels fall back to a loop for other dtypes. Saved for backward either
    way: the two matrices and the offsets, which is what this Function saves; the output is an
    empty tensor of the real shape ([S, K] x [E, K, N] -> [S, N]).
    """

    class _GroupedMM(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a, b, offs):
            ctx.save_for_backward(a, b, offs)
            return a.new_empty((a.shape[0], b.shape[-1]))

        @staticmethod
        def backward(ctx, grad):
            a, b, _ = ctx.saved_tensors
            return torch.zeros_like(a), torch.zeros_like(b), None

    def grouped_mm(mat_a, mat_b, *args, offs=None, bias=None, out_dtype=None, **kw):
        if (mat_a.dtype == torch.bfloat16 or mat_a.dim() != 2 or mat_b.dim() != 3 or bias is not None
                or out_dtype not in (None, mat_a.dtype) or args):
            return original(mat_a, mat_b, *args, offs=offs, bias=bias, out_dtype=out_dtype, **kw)
        return _GroupedMM.apply(mat_a, mat_b, offs)

    return grouped_mm


class _CudaDropout:
    """F.dropout as CUDA runs it, while measuring on fake CPU tensors: CUDA's native_dropout saves
    a bool mask (1 byte an element); CPU's dropout saves its noise in the input's dtype (4 bytes in
    fp32, 2 in bf16), which counted BERT's hidden dropouts 3.75 MiB too high against a real CUDA
    step (measured on an H200). Not in training, or p of 0 or 1: the real function."""

    def __init__(self, torch):
        self.torch = torch

    def __enter__(self):
        torch = self.torch
        F = torch.nn.functional
        self.original = original = F.dropout

        _Dropout = _bool_mask_dropout(torch)

        def dropout(input, p=0.5, training=True, inplace=False):
            if not training or p <= 0 or p >= 1 or not torch.is_grad_enabled():
                return original(input, p, training, inplace)
            return _Dropout.apply(input)

        F.dropout = dropout
        return self

    def __exit__(self, *exc):
        self.torch.nn.functional.dropout = self.original
        return False


class _One(float):
    """1.0 standing for a 0-d random tensor: compares as a number; .item() gives it back."""

    def item(self) -> float:
        return float(self)


class _RealScalarRand:
    """`torch.rand([])` (a 0-d random number) made outside fake mode while measuring: models draw one
    to decide in Python whether to skip a layer (OPT's, Whisper's and others' LayerDrop: `if
    torch.rand([]) < self.layerdrop: continue`), which on fake tensors is data-dependent and failed.
    It returns 1.0: no layer is skipped, the most memory a step can take (the notes say so)."""

    def __init__(self, torch):
        self.torch = torch
        self.used = 0

    def __enter__(self):
        torch = self.torch
        self.original = original = torch.rand
        def rand(*size, **kw):
            shape = size[0] if len(size) == 1 and isinstance(size[0], (list, tuple)) else size
            if len(shape) == 0 and not kw.get("requires_grad"):
                self.used += 1
                return _One(1.0)      # a number, so `rand < p` is a Python comparison, not a fake op
            return original(*size, **kw)

        torch.rand = rand
        return self

    def __exit__(self, *exc):
        self.torch.rand = self.original
        return False


class _GroupedMMForAnyDtype:
    """Swap torch.nn.functional.grouped_mm and torch._grouped_mm for _grouped_mm_shim while measuring."""

    def __init__(self, torch):
        self.torch = torch

    def __enter__(self):
        torch = self.torch
        self.saved = []
        for owner, name in ((torch.nn.functional, "grouped_mm"), (torch, "_grouped_mm")):
            fn = getattr(owner, name, None)
            if fn is not None:
                self.saved.append((owner, name, fn))
                setattr(owner, name, _grouped_mm_shim(torch, fn))
        return self

    def __exit__(self, *exc):
        for owner, name, fn in self.saved:
            setattr(owner, name, fn)
        return False


def _live_bytes_mode(torch):
    """A dispatch mode that follows the bytes of every storage the ops under it create, until the
    storage dies (a weakref finalizer: storages keep their Python object alive with them), and
    keeps the trace of (time, +/- bytes, storage) to replay once the gradients are known.

    An op's output that shares an input's storage (a view, an in-place op) is no new memory; so
    the parameters, the input and anything made before are never counted, only what the step
    makes: the forward's intermediate and saved tensors, the loss, the gradients, and the
    backward's transients (what the saved-tensor count alone cannot see: an MoE block's backward
    holds several [tokens x k, hidden] gradients at once, 2.5% of the peak at batch 16 on an H100).

    The ops run CPU (fake) kernels; where a CUDA kernel makes a tensor of its own that CPU's does
    not, the trace adds it as CUDA would: softmax's backward (SoftMax.cu softmax_backward_cuda_out)
    computes `tmp = grad * output` before its kernel, one more tensor of the gradient's size, live
    with the gradient it makes (eager and math attention's B x H x L x L in fp32: issue 34's
    estmla run, DeepSeek-V2-Lite eager bf16 on an H100, was 6.0% under without it).
    """
    softmax_backward = torch.ops.aten._softmax_backward_data.default
    import weakref
    # importlib, as everywhere here: gpumon.estimate imports no torch of its own (tests/test_layers.py)
    TorchDispatchMode = importlib.import_module("torch.utils._python_dispatch").TorchDispatchMode
    tree_leaves = importlib.import_module("torch.utils._pytree").tree_leaves

    class LiveBytes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.live: dict[int, tuple[int, int]] = {}   # storage address -> (uid, bytes), while alive
            self.events: list[tuple[int, int]] = []      # (uid, +bytes | -bytes); uids are never reused
            self.uid = 0

        def _freed(self, key, uid):
            if self.live.get(key, (None,))[0] == uid:
                self.events.append((uid, -self.live.pop(key)[1]))

        def uids(self, tensors) -> set[int]:
            """The uids of the live storages of these tensors."""
            return {self.live[t.untyped_storage()._cdata][0] for t in tensors
                    if _has_storage(t) and t.untyped_storage()._cdata in self.live}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            inputs = None
            for t in tree_leaves(out):
                if not isinstance(t, torch.Tensor) or not _has_storage(t):
                    continue   # no storage (a wrapper subclass): nothing to follow
                st = t.untyped_storage()
                key = st._cdata
                if key in self.live:
                    continue
                if inputs is None:
                    inputs = {a.untyped_storage()._cdata for a in tree_leaves((args, kwargs))
                              if isinstance(a, torch.Tensor) and _has_storage(a)}
                if key in inputs:
                    continue
                self.uid += 1
                n = st.nbytes()
                self.live[key] = (self.uid, n)
                self.events.append((self.uid, n))
                weakref.finalize(st, self._freed, key, self.uid)
            if func is softmax_backward:    # CUDA's temporary, alive with the gradient the op made
                self.uid += 1
                n = args[0].numel() * args[0].element_size()
                self.events += [(self.uid, n), (self.uid, -n)]
            return out

    return LiveBytes()


def _idle_modules(net, storages: set[int], most: int = 4) -> list[str]:
    """The outermost modules all of whose parameters are in `storages` (layer numbers as *), for
    saying which parameters a step left without a gradient."""
    import re
    def idle(m) -> bool:
        ps = list(m.parameters())
        return bool(ps) and all(p.untyped_storage()._cdata in storages for p in ps)
    names: list[str] = []
    idle_prefixes: list[str] = []
    for name, m in net.named_modules():
        if any(name.startswith(p + ".") for p in idle_prefixes) or not idle(m):
            continue
        idle_prefixes.append(name)
        short = re.sub(r"\.\d+(?=\.|$)", ".*", name) or type(m).__name__
        if short not in names:
            names.append(short)
    return names[:most] + ([f"{len(names) - most} more"] if len(names) > most else [])


def _has_storage(t) -> bool:
    try:
        t.untyped_storage()
        return True
    except Exception:
        return False


def step_front(events: list[tuple[int, int]], grad_uids: set[int], start: int = 0,
               points: int = 48) -> tuple[int, list[list[int]]]:
    """The moments of a traced step that could be its peak: the forward's high-water mark (events
    before `start`, where backward begins), and for backward [other bytes, gradient bytes] pairs
    (live then, above what existed before the step), the Pareto front of the two thinned to
    `points`. The estimate weighs the gradients (sharded by ZeRO, or already whole when they are
    kept from a micro-step before) and takes the largest sum."""
    other = grads = fwd_peak = 0
    front: list[tuple[int, int]] = []
    for i, (uid, n) in enumerate(events):
        if uid in grad_uids:
            grads += n
        else:
            other += n
        if i < start:
            fwd_peak = max(fwd_peak, other + grads)
        elif n > 0:
            front.append((other, grads))
    # keep the points no other point beats in both coordinates
    front.sort(key=lambda p: (-p[0], -p[1]))
    kept: list[tuple[int, int]] = []
    best_g = -1
    for o, g in front:
        if g > best_g:
            kept.append((o, g))
            best_g = g
    if len(kept) > points:
        step = len(kept) / points
        kept = [kept[int(i * step)] for i in range(points)] + [kept[-1]]
    return fwd_peak, [list(p) for p in kept]


def _as_if_unpadded(fn):
    """transformers' mask-skipping decision fn(padding_mask, ...) taken with no padding mask."""
    def decide(padding_mask, *a, **k):
        return fn(None, *a, **k)
    return decide


class _OneSequencePerRow:
    """Hugging Face's mask code decides on a GPU what it cannot decide on fake tensors.

    transformers (5.x) `masking_utils.find_packed_sequence_indices(position_ids)` returns None (no
    packed sequences, so the causal mask is skipped and sdpa runs with is_causal=True and, for
    grouped-query models, enable_gqa) only `if not is_tracing(mask) and (mask[:, -1] == 0).all()`;
    and its `is_tracing` is True for a FakeTensor. So on fake tensors HF builds a 4-D boolean mask,
    repeats k and v, and sdpa gets attn_mask: the math kernel with its B x H x L x L probabilities,
    not what the GPU runs (+44..98% on the s1024 rows of benchmarks/estimate_accuracy.md).
    The input --measure makes (token ids, no position_ids) is one sequence per row, for which the
    real answer is None: every loaded transformers module's find_packed_sequence_indices says so
    for the duration of the measurement.

    It is also unpadded, and the same `is_tracing` test made `_ignore_causal_mask_sdpa` (and its
    bidirectional twin) keep the mask whenever a padding mask is passed: transformers 5.17's
    OPTDecoder passes its own `torch.ones` attention_mask, which on the GPU is all ones, so sdpa runs
    is_causal with no mask; on fake tensors the 4-D mask was built and the memory-efficient
    kernel saved it as an fp32 bias in every layer (OPT-350m, b4 s1024 fp32: 24 x 16 MiB, +3.47% on
    an H100). The padding mask is all ones for our input, so the decision is made as for none
    (the sliding-window and offset tests still run).
    """

    PATCHES = {"find_packed_sequence_indices": lambda fn: (lambda position_ids, *a, **k: None),
               "_ignore_causal_mask_sdpa": lambda fn: _as_if_unpadded(fn),
               "_ignore_bidirectional_mask_sdpa": lambda fn: _as_if_unpadded(fn)}

    def __enter__(self):
        self.patched = []
        for name, mod in list(sys.modules.items()):
            if mod is None or not (name == "transformers" or name.startswith("transformers.")):
                continue
            # the module's own names only: getattr on transformers' lazy modules imports whatever
            # the name leads to (with transformers 5.17, a vision model needing torchvision)
            own = getattr(mod, "__dict__", {})
            for fn_name, make in self.PATCHES.items():
                fn = own.get(fn_name)
                if callable(fn):
                    self.patched.append((mod, fn_name, fn))
                    setattr(mod, fn_name, make(fn))
        return self

    def __exit__(self, *exc):
        for mod, fn_name, fn in reversed(self.patched):
            setattr(mod, fn_name, fn)
        return False


# transformers' attn_implementation for each --attn (flash, efficient and math are sdpa's kernels)
HF_IMPL = {"eager": "eager", "sdpa": "sdpa", "flash": "sdpa", "efficient": "sdpa", "math": "sdpa"}
# implementations a config may name that need a package or a GPU here: measured as sdpa with the
# kernel they save like (flash-attn's saves q, k, v, the output and a logsumexp, as sdpa's flash)
HF_IMPL_AS = {"flash_attention_2": "flash", "flash_attention_3": "flash", "kernels-community/flash-attn": "flash",
              "flex_attention": "efficient"}


def build_from_config(torch, config_path: str, dtype, attn: str | None):
    """The model transformers builds from the config, with the attention implementation the
    user's run would get: --attn's, else the config's attn_implementation, else transformers' own
    default for that model (sdpa where the model supports it, eager otherwise: BLOOM, GPT-J and
    Mamba were refused when sdpa was always asked for). Returns (model, implementation, forced
    sdpa kernel or None)."""
    try:
        transformers = importlib.import_module("transformers")
    except ImportError:
        raise MeasureError("--measure with --config needs transformers installed (pip install transformers); "
                           "without it the analytical formula is used when --measure is left out") from None
    import json
    from pathlib import Path
    from .arch import multimodal_refusal
    p = Path(config_path)
    cfg = json.loads((p / "config.json" if p.is_dir() else p).read_text())
    mm = multimodal_refusal(cfg, str(config_path))
    if mm:
        raise MeasureError(mm)
    cfg["use_cache"] = False          # a training forward does not need the KV cache
    mt = cfg.pop("model_type", None)
    if not mt:
        raise MeasureError(f"{config_path} has no model_type")
    from_cfg = cfg.pop("attn_implementation", None) or cfg.pop("_attn_implementation", None)
    forced = None
    if attn is not None:
        impl = HF_IMPL[attn]
    elif isinstance(from_cfg, str) and from_cfg in HF_IMPL_AS:
        impl, forced = "sdpa", HF_IMPL_AS[from_cfg]
    elif isinstance(from_cfg, str):
        impl = from_cfg
    else:
        impl = None          # transformers' default for this model
    with _quiet_transformers():
        try:
            config = transformers.AutoConfig.for_model(mt, **cfg)
        except (ValueError, KeyError) as e:
            raise MeasureError(f"transformers {transformers.__version__} does not know model_type {mt!r}: "
                               f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
        except Exception as e:   # a config transformers' own checks refuse
            raise MeasureError(f"transformers refuses this {mt} config: {type(e).__name__}: "
                               f"{str(e).splitlines()[0][:200] if str(e) else ''}") from None
        auto = transformers.AutoModelForCausalLM
        mapping = getattr(auto, "_model_mapping", None)
        try:
            known = mapping is None or type(config) in mapping
        except Exception:   # a lazy mapping that cannot answer: let from_config say
            known = True
        if not known:
            raise MeasureError(f"transformers has no causal language model for model_type {mt!r} (an "
                               "encoder-decoder or a vision model?): --measure with --config builds "
                               "AutoModelForCausalLM; build yours with --model pkg.mod:factory (and "
                               "example_input(batch, seq) next to it)")
        if getattr(config, "is_encoder_decoder", False):
            # AutoModelForCausalLM gives Whisper, BART, mBART... their decoder alone (WhisperForCausalLM):
            # the encoder would be left out without a word
            raise MeasureError(f"{mt} is an encoder-decoder model: transformers' causal LM for it is the decoder "
                               "alone, so the encoder would be left out; build the whole model with --model "
                               "pkg.mod:factory (and example_input(batch, seq) next to it)")
        kw = {} if impl is None else {"attn_implementation": impl}
        try:      # transformers >= 4.56 takes dtype=; older ones torch_dtype= (newer ones log a deprecation)
            try:
                net = auto.from_config(config, dtype=dtype, **kw)
            except TypeError:
                net = auto.from_config(config, torch_dtype=dtype, **kw)
        except (ValueError, ImportError) as e:
            if impl is not None and ("attn" in str(e).lower() or "attention" in str(e).lower()):
                other = "eager" if impl != "eager" else "sdpa"
                raise MeasureError(f"transformers cannot build {mt} with attn_implementation={impl!r}: "
                                   f"{str(e).splitlines()[0][:160]} (try --attn {other}, or leave --attn out for "
                                   "the model's own default)") from None
            raise
    got = getattr(getattr(net, "config", None), "_attn_implementation", None) or impl or "?"
    return net, got, forced


def hf_impl_from_cfg(config_path: str) -> str | None:
    """The attn_implementation a config file names, if any."""
    import json
    from pathlib import Path
    try:
        p = Path(config_path)
        cfg = json.loads((p / "config.json" if p.is_dir() else p).read_text())
        v = cfg.get("attn_implementation") or cfg.get("_attn_implementation")
        return v if isinstance(v, str) else None
    except (OSError, ValueError):
        return None


def _adopt_fake_mode(torch, net, mode) -> None:
    """Parameters and buffers made outside `mode` become fake tensors of `mode`.

    copy.deepcopy of a fake parameter (nn.TransformerEncoder clones its layer that way) makes a
    tensor of a new FakeTensorMode, and the forward then fails with "Mixing fake modes NYI". Fake
    tensors hold no data, so an empty tensor of the same shape, dtype and requires_grad is the
    same thing to the measurement; shared (tied) tensors stay shared.
    """
    fake_tensor = importlib.import_module("torch._subclasses.fake_tensor")
    made: dict[int, tuple[Any, Any]] = {}     # id(old) -> (old, kept alive so ids stay unique; new)

    def own(t):
        return isinstance(t, fake_tensor.FakeTensor) and t.fake_mode is mode

    def remake(t, param: bool):
        if id(t) not in made:
            with mode:
                new = torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device="cpu")
            if param:
                new = torch.nn.Parameter(new, requires_grad=t.requires_grad)
            made[id(t)] = (t, new)
        return made[id(t)][1]

    for m in net.modules():
        for name, p in list(m._parameters.items()):
            if p is not None and not own(p):
                m._parameters[name] = remake(p, True)
        for name, b in list(m._buffers.items()):
            if b is not None and not own(b):
                m._buffers[name] = remake(b, False)


def _infer_input(torch, net, batch: int, seq: int):
    """(input, description) for a module without example_input, or (None, why not).

    Token ids when the model says its vocabulary (a Hugging Face config, or vocab_size) or when its
    first module with parameters is an nn.Embedding; a float [batch, seq, features] tensor when that
    module is an nn.Linear or a transformer encoder layer ([seq, batch, d] unless batch_first).
    """
    nn = torch.nn
    vocab = getattr(getattr(net, "config", None), "vocab_size", None) or getattr(net, "vocab_size", None)
    if vocab:
        return torch.zeros((batch, seq), dtype=torch.long), f"token ids [{batch}, {seq}] (vocab {vocab})"
    first = next((m for m in net.modules() if any(True for _ in m.parameters(recurse=False))
                  or isinstance(m, (nn.TransformerEncoderLayer, nn.TransformerEncoder))), None)
    if isinstance(first, nn.TransformerEncoder):
        first = first.layers[0]
    if isinstance(first, nn.Embedding):
        return (torch.zeros((batch, seq), dtype=torch.long),
                f"token ids [{batch}, {seq}] (the first module is Embedding({first.num_embeddings}, "
                f"{first.embedding_dim}))")
    if isinstance(first, nn.Linear):
        return (torch.empty((batch, seq, first.in_features)),
                f"a float tensor [{batch}, {seq}, {first.in_features}] (the first module is Linear({first.in_features}, "
                f"{first.out_features}))")
    if isinstance(first, nn.TransformerEncoderLayer):
        d = first.self_attn.embed_dim
        shape = (batch, seq, d) if first.self_attn.batch_first else (seq, batch, d)
        return torch.empty(shape), f"a float tensor {list(shape)} (the first module is a TransformerEncoderLayer)"
    return None, (f"its first module is {type(first).__name__}" if first is not None else "it has no parameters")


def measure_activations(batch: int, seq: int, dtype: str = "fp32", model: str | None = None,
                        config: str | None = None, attn: str | None = None, device: str = "fake",
                        factory: Callable[..., Any] | None = None, amp: bool = False,
                        freeze_embeddings: bool = False) -> dict:
    """Count autograd's saved bytes for one forward of the model at (batch, seq).

    The factory is called as factory(batch=..., seq=...) if it accepts them, else factory(), and
    returns an nn.Module; its input is `module.example_input(batch, seq)` when the module (or the
    factory's module) defines `example_input`, else one inferred from the model (token ids for a
    language model or a model starting with an nn.Embedding; a float tensor for one starting with an
    nn.Linear or a transformer encoder layer), which the result names.
    Warnings torch or the model raise while this runs are kept out of the user's screen and
    counted in the notes. attn None: the model's own implementation (the config's, else
    transformers' default), its sdpa calls routed as CUDA routes them. Any failure is a
    MeasureError (one line), never a traceback.
    """
    if amp:
        raise MeasureError("autocast cannot run on fake tensors, so --measure cannot count it; "
                           "leave out --measure to use the analytical formula for --amp")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with _quiet_transformers_all():
                result = _measure(batch, seq, dtype, model, config, attn, device, factory, freeze_embeddings)
        except MeasureError:
            raise
        except Exception as e:     # anything else is still one line (issue 34: DeepSeek-V2 crashed)
            if os.environ.get("GPUMON_DEBUG"):
                import traceback
                traceback.print_exc()
            first = str(e).splitlines()[0][:300] if str(e) else ""
            raise MeasureError(f"the measurement failed: {type(e).__name__}: {first}") from None
    hidden = sorted({f"{w.category.__name__}: {str(w.message).splitlines()[0][:120]}" for w in caught})
    if hidden:
        result["notes"].append(f"{len(caught)} warning(s) from torch or the model during the measurement were "
                               f"hidden ({len(hidden)} distinct; --json lists them)")
        result["hidden_warnings"] = hidden
    return result


@contextlib.contextmanager
def _quiet_transformers_all():
    """transformers' logs (e.g. Mamba's "falling back to its reference PyTorch implementation") stay
    off the user's screen while the model is built and run; its logger is imported lazily, so
    this also covers a transformers imported during the measurement."""
    import logging
    lg = logging.getLogger("transformers")
    old = lg.level if "transformers" in sys.modules else logging.WARNING   # transformers' own default
    lg.setLevel(logging.ERROR)
    try:
        with _quiet_transformers():
            yield
    finally:
        lg.setLevel(old)


def _quiet_transformers():
    """transformers logs through `logging` (not warnings): silence it while the model is built."""
    tl = sys.modules.get("transformers.utils.logging")
    if tl is None:
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def cm():
        old = tl.get_verbosity()
        tl.set_verbosity_error()
        try:
            yield
        finally:
            tl.set_verbosity(old)
    return cm()


def _freeze_embeddings(torch, net) -> int:
    """requires_grad=False on the input embedding (a tied output head shares it); returns the count."""
    emb = None
    get_in = getattr(net, "get_input_embeddings", None)
    if callable(get_in):
        try:
            emb = get_in()
        except (NotImplementedError, AttributeError):
            emb = None
    mods = [emb] if emb is not None else [m for m in net.modules() if isinstance(m, torch.nn.Embedding)]
    for m in mods:
        for p in m.parameters():
            p.requires_grad_(False)
    return len(mods)


def _measure(batch, seq, dtype, model, config, attn, device, factory, freeze_embeddings) -> dict:
    torch = _torch()
    tdtype = getattr(torch, DTYPES[dtype])
    mode = None
    if device == "fake":
        # FakeTensorMode: CPU-typed tensors with no data. Unlike the meta device it lets code such as
        # Hugging Face's rotary embedding enter `torch.autocast(device_type=..., enabled=False)`.
        fake_tensor = importlib.import_module("torch._subclasses.fake_tensor")
        mode = dev = fake_tensor.FakeTensorMode()
    else:
        dev = torch.device(device)
    example = None
    input_note = ""
    hf_impl, cfg_forced = None, None
    old_default = torch.get_default_dtype()
    try:
        torch.set_default_dtype(tdtype)    # build in the target dtype: .to() cannot swap fake parameters
        with dev:
            if factory is None and model:
                factory = load_factory(model)
            if factory is not None:
                try:
                    net = factory(batch=batch, seq=seq)
                except TypeError:
                    net = factory()
                if not isinstance(net, torch.nn.Module):
                    raise MeasureError(f"the factory returned {type(net).__name__}, not an nn.Module")
                mod = sys.modules.get(getattr(factory, "__module__", ""), None)
                example = getattr(net, "example_input", None) or getattr(mod, "example_input", None)
            elif config:
                net, hf_impl, cfg_forced = build_from_config(torch, config, tdtype, attn)
            else:
                raise MeasureError("--measure needs --model pkg.mod:factory or --config")
            if config:    # transformers configured its logger on import, inside the build: quiet it again
                import logging
                logging.getLogger("transformers").setLevel(logging.ERROR)
            if mode is not None:
                _adopt_fake_mode(torch, net, mode)
            # a config's model keeps what transformers keeps in fp32 (transformers 5.25 keeps
            # MoE router gates so: the user's run has them too, and fake parameters can't be
            # swapped); a factory's model is cast to the dtype asked for
            if factory is not None and any(p.dtype != tdtype for p in net.parameters()
                                           if p.is_floating_point()):
                net = net.to(dtype=tdtype)
            net.train()
            if freeze_embeddings and not _freeze_embeddings(torch, net):
                raise MeasureError("--freeze-embeddings: the model has no nn.Embedding to freeze")
            if example is not None:
                inp = example(batch, seq)
            else:
                inp, input_note = _infer_input(torch, net, batch, seq)
                if inp is None:
                    raise MeasureError(f"cannot tell the model's input ({input_note}): define "
                                       "example_input(batch, seq) next to the factory")
    except MeasureError:
        raise
    except Exception as e:
        first = str(e).splitlines()[0] if str(e) else ""
        raise MeasureError(f"could not build the model on {device}: {type(e).__name__}: {first[:300]}") from None
    finally:
        torch.set_default_dtype(old_default)

    params = [p for _, p in net.named_parameters(remove_duplicate=False)]
    by_storage: dict[int, tuple[int, bool, int]] = {}
    shapes: dict[int, tuple[int, ...]] = {}
    for p in params:
        key = p.untyped_storage()._cdata
        prev = by_storage.get(key)
        by_storage[key] = (p.numel(), p.requires_grad or (prev[1] if prev else False), p.numel())
        shapes.setdefault(key, tuple(p.shape))
    param_keys = set(by_storage)
    buffer_keys = {b.untyped_storage()._cdata for b in net.buffers()}
    n_params = sum(v[0] for v in by_storage.values())
    n_train = sum(v[0] for v in by_storage.values() if v[1])
    largest = max((v[0] for v in by_storage.values()), default=0)
    largest_train = max((v[0] for v in by_storage.values() if v[1]), default=0)
    tied = len(by_storage) < len(params)
    head_numel = 0
    get_out = getattr(net, "get_output_embeddings", None)
    if callable(get_out):
        try:
            head = get_out()
        except (NotImplementedError, AttributeError):
            head = None
        if head is not None and getattr(head, "weight", None) is not None:
            head_numel = head.weight.numel()

    saved: dict[int, int] = {}
    kinds: dict[str, int] = {}
    saved_dtype: dict[int, str] = {}
    forward_open = [True]

    def died(key: int, token: object) -> None:
        # A saved storage freed during forward: its node died with an output nobody used (DeepSeek-V3's
        # router: topk(...)[1] drops the values, and with them the nodes that saved the group scores'
        # indices and the mask). It is not held for backward, and its address may be reused by the
        # next storage, which the dedup by address then skipped: the count changed from run to run.
        if forward_open[0] and key in saved and saved_token.get(key) is token:
            n = saved.pop(key)
            kinds[saved_dtype[key]] -= n
            del saved_token[key]

    saved_token: dict[int, object] = {}

    def pack(t):
        try:
            st = t.untyped_storage()
            key = st._cdata
        except Exception:   # a tensor without storage (e.g. a wrapper subclass): count its bytes
            key, st = id(t), None
        if key in param_keys or key in buffer_keys:
            return t
        if key not in saved:
            saved[key] = st.nbytes() if st is not None else t.numel() * t.element_size()
            saved_dtype[key] = str(t.dtype)
            kinds[str(t.dtype)] = kinds.get(str(t.dtype), 0) + saved[key]
            if st is not None:
                token = saved_token[key] = object()
                weakref.finalize(st, died, key, token)
        return t

    F = torch.nn.functional
    original = F.scaled_dot_product_attention
    router = _sdpa_router(torch, original, attn if attn in ("flash", "efficient", "math") else cfg_forced)
    # our own input (token ids, no position_ids) is one sequence per row: say so to HF's mask code
    one_seq = _OneSequencePerRow() if example is None else contextlib.nullcontext()
    live = _live_bytes_mode(torch)
    scalar_rand = _RealScalarRand(torch)
    try:
        F.scaled_dot_product_attention = router
        with one_seq, _GroupedMMForAnyDtype(torch), _CudaDropout(torch), scalar_rand, dev, live, \
                torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = net(inp)
        forward_open[0] = False       # what is saved now is what backward holds
        logits = out
        if not torch.is_tensor(logits):
            logits = getattr(out, "logits", None)
            if logits is None and isinstance(out, (tuple, list)):
                logits = out[0]
        if not torch.is_tensor(logits):
            raise MeasureError("the model's output is neither a tensor nor has .logits")
        out_numel, out_bytes = logits.numel(), logits.numel() * logits.element_size()
        out_is_2d = logits.dim() >= 2
        # in the mode as well: a backward formula that makes a tensor from sizes alone (torch
        # 2.11's gather backward: zeros, then scatter) makes a real one outside it. The output
        # is let go before backward, as `model(x).loss.backward()` lets it go.
        with dev, live:
            loss = (logits if logits.is_floating_point() else logits.float()).mean()
            del out, logits
            bwd_from = len(live.events)
            loss.backward()
            del loss
    except MeasureError:
        raise
    except Exception as e:
        if os.environ.get("GPUMON_DEBUG"):  # the whole traceback, for a bug report
            import traceback
            traceback.print_exc()
        msg = str(e).splitlines()[0][:300] if str(e) else ""
        if config and factory is None and not model:
            # a --config user has no factory to put example_input next to (OPT, Whisper got that hint)
            hint = (f"transformers' {type(net).__name__} (attn_implementation {hf_impl}) does not run on fake "
                    "tensors" + ("; try --attn eager" if hf_impl != "eager" else "")
                    + "; or build it yourself with --model pkg.mod:factory")
        elif input_note:
            hint = ("define example_input(batch, seq) next to the factory, or leave out --measure to use the "
                    "analytical formula")
        else:
            hint = "leave out --measure to use the analytical formula"
        raise MeasureError(f"could not run forward/backward on {device}: {type(e).__name__}: {msg} ({hint})") from None
    finally:
        F.scaled_dot_product_attention = original
    notes = []
    if input_note:
        notes.append(f"input: {input_note}, inferred (define example_input(batch, seq) to choose it)")
    # What trains is what the traced backward gave a gradient: torch.optim skips a parameter whose
    # .grad is None (no state, no update), so one the step never runs (GPT-2's cross-attention
    # without encoder states) costs its parameters only
    with_grad = {p.untyped_storage()._cdata for p in params if p.grad is not None}
    no_grad = {k for k, v in by_storage.items() if v[1] and k not in with_grad}
    by_storage = {k: (v[0], v[1] and k not in no_grad, v[2]) for k, v in by_storage.items()}
    n_no_grad = sum(by_storage[k][0] for k in no_grad)
    if no_grad:
        n_train -= n_no_grad
        largest_train = max((v[0] for v in by_storage.values() if v[1]), default=0)
        notes.append(f"{n_no_grad:,} parameters got no gradient in the traced step ("
                     + ", ".join(_idle_modules(net, no_grad)) + "): the step never runs them, so no gradient "
                     "and no optimizer state are counted for them")
    if router.kernels:
        saves = {"flash": "flash (saves q, k, v, output, fp32 logsumexp)",
                 "efficient": "memory-efficient (saves q, k, v, output, fp32 logsumexp)",
                 "cudnn": "cuDNN (saves q, k, v, output in q's layout, fp32 softmax stats)",
                 "efficient with a mask": "memory-efficient with a mask (also saves the mask as a bias)",
                 "flash with a mask": "flash (the mask left out)",
                 "math": "math (16-bit inputs upcast to fp32; saves the fp32 B x H x L x L probabilities)"}

        def say(k: str) -> str:
            base, _, drop = k.partition(" and dropout")
            return saves.get(base, base) + (
                (", dropout: a bool mask and the dropped probabilities" if base == "math"
                 else ", dropout: a seed, no mask") if drop or k.endswith("and dropout") else "")
        notes.append("attention counted as CUDA's sdpa kernel would save it: "
                     + ", ".join(say(k) for k in sorted(router.kernels)))
    if config and factory is None and not model:
        notes.append(f"built with transformers as {type(net).__name__}, attn_implementation {hf_impl!r} ("
                     + ("--attn" if attn else "the config's" if cfg_forced or hf_impl_from_cfg(config) else
                        "transformers' default for this model") + ")"
                     + (f", measured as sdpa's {cfg_forced} kernel saves" if cfg_forced else ""))
    if scalar_rand.used:
        notes.append(f"{scalar_rand.used} random draw(s) of a 0-d tensor (LayerDrop) taken as 1.0: no layer "
                     "skipped, the step's most memory")
    if freeze_embeddings:
        notes.append("embeddings frozen (requires_grad=False) in the measured model")
    return {
        "n_params": n_params, "n_trainable": n_train, "n_no_grad": n_no_grad, "largest_param": largest,
        "largest_trainable": largest_train, "tied": tied, "head_numel": head_numel,
        # the trainable tensors' shapes: Adafactor's factored state, 8-bit Adam's blocks
        "param_shapes": [list(shapes[k]) for k, v in by_storage.items() if v[1]],
        "attn_implementation": hf_impl,
        "saved_bytes": sum(saved.values()), "saved_tensors": len(saved), "saved_by_dtype": kinds,
        "output_bytes": out_bytes,
        "output_numel": out_numel if out_is_2d and head_numel else 0,
        # the traced step's moments (the output's mean as the loss): see step_front
        "trace": step_front(live.events, live.uids(p.grad for p in params if p.grad is not None), bwd_from),
        "attention": ", ".join(sorted(router.kernels)) if router.kernels else attn,
        "device": device, "notes": notes,
    }
