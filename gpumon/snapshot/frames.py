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
# interpreter's and dispatcher's plumbing. gpumon also hides the C runtime's and CPython's
# start-up frames (_start, __libc_init_first, Py_RunMain, PyCMethod_New, ...), which memory_viz
# shows. File names are matched by their base name: torch writes bare names for its generated
# files (RegisterCUDA_0.cpp, not .../RegisterCUDA_0.cpp).
_OMIT_FUNCTIONS = ("unwind::unwind", "CapturedTraceback::gather", "gather_with_cpp")
# a C symbol that is the runtime's start-up or a thread's: hidden whole
_OMIT_EXACT = frozenset(("_start", "__libc_start_main", "__libc_start_call_main",
                         "__libc_init_first", "start_thread", "clone", "clone3", "main",
                         "cfunction_call", "cfunction_vectorcall_O",
                         "cfunction_vectorcall_FASTCALL", "cfunction_vectorcall_NOARGS",
                         "cfunction_vectorcall_FASTCALL_KEYWORDS", "method_vectorcall_O",
                         "method_vectorcall_NOARGS", "method_vectorcall_FASTCALL",
                         "method_vectorcall_VARARGS", "method_vectorcall_VARARGS_KEYWORDS",
                         "method_vectorcall_FASTCALL_KEYWORDS", "slot_tp_call",
                         "vectorcall_method", "call_function", "run_mod", "run_eval_code_obj",
                         "_PyEval_EvalFrameDefault"))
# CPython's API and internals are named Py*/_Py* (PyCMethod_New, Py_RunMain, _PyObject_Call)
_CPYTHON_NAME = re.compile(r"_?Py(?:[A-Z]|_)")
_OMIT_BASENAMES = ("pythonrun.c", "main.c", "call.c", "methodobject.c", "descrobject.c",
                   "typeobject.c", "abstract.h", "pycore_call.h", "pycore_ceval.h", "ceval.c",
                   "generated_cases.c.h", "bytecodes.c", "funcobject.c", "classobject.c",
                   "ceval_macros.h", "boxing.h", "KernelFunction_impl.h",
                   "make_boxed_from_unboxed_functor.h", "BoxedKernel_impl.h")
_OMIT_PREFIXES = ("Register", "Redispatch")  # torch's generated RegisterCUDA_0.cpp, ...
_OMIT_PATHS = ("core/boxing", "Modules/main.c", "Objects/call.c", "cpython/abstract.h")
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
    if name in _OMIT_EXACT or _CPYTHON_NAME.match(name):
        return False
    for o in _OMIT_FUNCTIONS:
        if o in name:
            return False
    base = fn.replace("\\", "/").rsplit("/", 1)[-1]
    if base in _OMIT_BASENAMES or base.startswith(_OMIT_PREFIXES):
        return False
    for o in _OMIT_PATHS:
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


def python_first(frames) -> tuple[tuple, tuple, tuple]:
    """A stack (innermost first) in the order a reader wants it: (the user's frame and the
    library frames it called on the way to the allocation, in call order; the Python frames
    that called the user's frame, innermost first; the C++ frames, innermost first). The
    first of the first part is the frame the stack is known by (see user_frame): the first
    user Python frame, else the innermost Python frame. ((), (), frames) when no frame is
    Python."""
    py = [k for k, f in enumerate(frames) if f[0].endswith(".py")]
    cpp = tuple(f for f in frames if not f[0].endswith(".py"))
    if not py:
        return (), (), cpp
    u = next((k for k in py if is_user_frame(frames[k][0])), py[0])
    led = tuple(frames[k] for k in reversed(py) if k < u)
    return (frames[u],) + led, tuple(frames[k] for k in py if k > u), cpp


def stackless_name(cpp_frames=(), phase: str | None = None, module: str | None = None,
                   grad_of: str | None = None, param_of: str | None = None) -> str | None:
    """The name of an allocation with no Python frame, from what gpumon knows of it, most
    telling first: the parameter whose .grad it is (`grad_of`: the agent saw it at the
    optimizer step), the autograd node or op in its C++ frames (stacks='all'), the module
    (`module`: its path, where the agent annotated it) and the phase of the training loop
    (`phase`: forward, backward, optimizer, ...) it was made in; `param_of`: it is the storage
    of a parameter of that model (the agent saw its address). None when nothing is known."""
    if grad_of:
        return f"gradients of {grad_of}"
    if param_of:
        return f"parameters of {param_of}"
    if cpp_frames:
        c = cpp_caller(cpp_frames)
        if c:
            return c
    if phase and module:
        return f"made in {phase} of {module}"
    if phase:
        return f"made in {phase}"
    if module:
        return f"made in {module}"
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
