"""Which frames of a snapshot's stacks are the user's, and how a frame is named.

Python frames are the user's unless they lie in a library (torch, site-packages, the standard
library, gpumon). A stacks='all' trace also holds C++ frames: the unwinder's, the interpreter's
and the dispatcher's are hidden as memory_viz hides them, and so are the caching allocator's own;
a stack with no Python frame is named by its autograd node, its ATen op, or its first C++ caller.
Pure functions of frame tuples (filename, line, name): no trace, no torch, no textual.
"""
from __future__ import annotations

import os
import re

from .load import int_field as _i

# A frame is library code (not the user's) when its file lies in one of these.
_LIB_MARKERS = ("/torch/", "\\torch\\", "site-packages", "dist-packages", "<frozen", "<built-in",
                "/lib/python3", "/lib64/python3", "/gpumon/")
# torch's own memory_viz (MemoryViz.js frameFilter, torch/cuda/_memory_viz.py _frame_filter)
# hides these frames of a stacks='all' trace: the unwinder that took the stack and the
# interpreter's and dispatcher's plumbing.
_OMIT_FUNCTIONS = ("unwind::unwind", "CapturedTraceback::gather", "gather_with_cpp", "_start",
                   "__libc_start_main", "PyEval_", "PyObject_", "PyFunction_")
_OMIT_FILENAMES = ("core/boxing", "/Register", "/Redispatch", "pythonrun.c", "Modules/main.c",
                   "Objects/call.c", "Objects/methodobject.c", "pycore_ceval.h", "ceval.c",
                   "cpython/abstract.h")
# ... and gpumon hides the caching allocator's own frames as well: every stack starts there.
_ALLOCATOR_FUNCTIONS = ("CUDACachingAllocator", "c10::cuda::CUDAAllocator", "c10::Allocator::",
                        "NativeCachingAllocator", "DeviceCachingAllocator")
# Glue between an op and the allocator, skipped when a C++-only stack is named by its caller.
GLUE_FUNCTIONS = ("at::detail::", "at::empty", "at::native::empty", "c10::impl::",
                  "c10::Dispatcher", "c10::OperatorHandle", "c10::KernelFunction",
                  "at::TensorBase", "c10::StorageImpl", "c10::make_intrusive", "c10::intrusive",
                  "(anonymous namespace)::create_out", "(anonymous namespace)::resize_out",
                  "at::native::resize", "at::_ops::empty", "at::_ops::resize",
                  "torch::autograd::VariableType", "torch::ADInplaceOrView",
                  "c10::BoxedKernel", "c10::function_ref")
_AUTOGRAD_NODE = re.compile(r"torch::autograd::(?:generated::)?(\w+)::apply\b")
_ATEN_OP = re.compile(r"at::_ops::(\w+)::(?:call|redispatch)\b")


def frame_tuple(f) -> tuple[str, int, str]:
    if isinstance(f, dict):
        return (str(f.get("filename", "?")), _i(f.get("line", 0)), str(f.get("name", "?")))
    return ("?", 0, str(f))


def is_shown_frame(fr: tuple) -> bool:
    """False for the frames memory_viz hides (the unwinder, interpreter and dispatcher
    plumbing) and for the caching allocator's own frames."""
    fn, _line, name = fr
    if fn.endswith(".py"):
        return True
    for o in _OMIT_FUNCTIONS:
        if o in name:
            return False
    for o in _OMIT_FILENAMES:
        if o in fn:
            return False
    for o in _ALLOCATOR_FUNCTIONS:
        if o in name:
            return False
    return True


def _short_cpp(name: str) -> str:
    """A C++ symbol without its parameter list ("at::_ops::mm::call(at::Tensor const&)" ->
    "at::_ops::mm::call")."""
    s = name.replace("(anonymous namespace)", "{anon}")
    k = s.find("(")
    if k > 0:
        s = s[:k]
    return s.replace("{anon}", "(anonymous namespace)").strip()[:80]


def cpp_caller(frames) -> str | None:
    """The name of a stack with no Python frame (stacks='all'): its autograd node when it has
    one ("autograd MmBackward0"), else the ATen op it ran ("aten::mm"), else its first C++
    frame past the unwinder, the allocator and the dispatch glue. None when there is none."""
    for f in frames:
        m = _AUTOGRAD_NODE.search(f[2])
        if m:
            return f"autograd {m.group(1)}"
    op = None
    for f in frames:  # innermost first: the last match is the outermost op
        m = _ATEN_OP.search(f[2])
        if m and not m.group(1).startswith(("empty", "resize")):
            op = m.group(1)
    if op:
        return f"aten::{op}"
    for f in frames:
        if is_shown_frame(f) and not any(g in f[2] for g in GLUE_FUNCTIONS) \
                and f[2] not in ("??", "") and not f[2].startswith("0x"):
            return _short_cpp(f[2])
    return None


def short_path(fn: str) -> str:
    """The last two parts of a path: enough to tell model.py of two projects apart."""
    parts = fn.replace("\\", "/").rstrip("/").split("/")
    return "/".join(parts[-2:]) if len(parts) > 1 else fn


def library_of(filename: str) -> str:
    """The top package of a Python file: "torch" for .../site-packages/torch/nn/functional.py,
    "python" for the standard library, "your code" for anything else."""
    f = filename.replace("\\", "/")
    for m in ("/site-packages/", "/dist-packages/"):
        k = f.rfind(m)
        if k >= 0:
            rest = f[k + len(m):].split("/", 1)[0]
            return rest[:-3] if rest.endswith(".py") else rest
    if f.startswith("<frozen") or "/lib/python3" in f or "/lib64/python3" in f:
        return "python"
    if "/torch/" in f:
        return "torch"
    return "your code"


def is_user_frame(filename: str) -> bool:
    if not filename.endswith(".py"):
        return False  # C++ frames (stacks='all') and <string>
    return not any(m in filename for m in _LIB_MARKERS)


def fmt_frame(fr: tuple[str, int, str], full: bool = False) -> str:
    fn, line, name = fr
    if not full:
        fn = os.path.basename(fn) or fn
    return f"{fn}:{line} {name}"
