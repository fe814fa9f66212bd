"""Issue 33, item 1: stacks are shown Python first (pane, summary, HTML, JSON), the frame filter
matches torch's bare file names and hides the interpreter's and libc's start-up frames.

The stacks are the shape torch's combined unwinder records with stacks='all' (innermost
first): the unwinder, the allocator, ATen's generated files by their bare names
(RegisterCUDA_0.cpp), the Python bindings, CPython's frames, the Python frames, and the
process's start-up (Py_RunMain, __libc_init_first, _start). At a real run's peak a median of
18 C++ frames came before the first Python one."""
import json
import pickle

from gpumon.snapshot import Snapshot, open_snapshot
from gpumon.snapshot import report
from gpumon.snapshot.frames import is_shown_frame


def F(fn, line, name):
    return {"filename": fn, "line": line, "name": name}


ALLOCATOR = [
    F("??", 0, "torch::unwind::unwind()"),
    F("/pytorch/torch/csrc/profiler/combined_traceback.cpp", 73,
      "torch::CapturedTraceback::gather(bool, bool, bool)"),
    F("CUDACachingAllocator.cpp", 1580, "c10::cuda::CUDACachingAllocator::Native::"
      "DeviceCachingAllocator::malloc(signed char, unsigned long, CUstream_st*)"),
    F("CUDACachingAllocator.cpp", 3890, "c10::cuda::CUDACachingAllocator::Native::"
      "NativeCachingAllocator::allocate(unsigned long)"),
    F("EmptyTensor.cpp", 200, "at::detail::empty_generic(c10::ArrayRef<long>, ...)"),
    F("EmptyTensor.cpp", 50, "at::detail::empty_cuda(c10::ArrayRef<long>, ...)"),
    F("RegisterCUDA_0.cpp", 4211, "at::(anonymous namespace)::create_out(...)"),
    F("RegisterCUDA_0.cpp", 4302, "at::(anonymous namespace)::wrapper_CUDA_addmm(...)"),
    F("make_boxed_from_unboxed_functor.h", 468,
      "c10::impl::wrap_kernel_functor_unboxed_<...>::call(...)"),
    F("Operators_2.cpp", 1012, "at::_ops::addmm::redispatch(...)"),
    F("VariableType_3.cpp", 5530, "torch::autograd::VariableType::(anonymous namespace)::"
      "addmm(...)"),
    F("Operators_2.cpp", 1000, "at::_ops::addmm::call(...)"),
    F("python_nn_functions.cpp", 2500, "torch::autograd::THPVariable_linear(_object*, ...)"),
    F("??", 0, "cfunction_call"),
    F("call.c", 242, "_PyObject_MakeTpCall"),
    F("??", 0, "PyCMethod_New"),
    F("ceval.c", 4200, "_PyEval_EvalFrameDefault"),
]
START = [
    F("pythonrun.c", 1700, "run_mod"),
    F("pythonrun.c", 1600, "_PyRun_SimpleFileObject"),
    F("main.c", 700, "Py_RunMain"),
    F("main.c", 750, "Py_BytesMain"),
    F("??", 0, "__libc_init_first"),
    F("??", 0, "__libc_start_main"),
    F("??", 0, "_start"),
]
LINEAR = "/usr/lib/python3.12/site-packages/torch/nn/modules/linear.py"
MODULE = "/usr/lib/python3.12/site-packages/torch/nn/modules/module.py"
FORWARD = ALLOCATOR + [
    F(LINEAR, 125, "forward"),
    F("ceval.c", 4200, "_PyEval_EvalFrameDefault"),
    F(MODULE, 1750, "_call_impl"),
    F("/home/u/proj/model.py", 42, "forward"),
    F(MODULE, 1750, "_call_impl"),
    F("/home/u/proj/train.py", 7, "main"),
    F("/home/u/proj/train.py", 20, "<module>"),
] + START
LIBRARY_ONLY = ALLOCATOR + [
    F(LINEAR, 125, "forward"),
    F(MODULE, 1750, "_call_impl"),
] + START
BACKWARD = ALLOCATOR[:6] + [
    F("Operators_0.cpp", 300, "at::_ops::mm::call(...)"),
    F("FunctionsManual.cpp", 1200, "torch::autograd::generated::details::mm_mat2_backward(...)"),
    F("Functions.cpp", 2100, "torch::autograd::generated::MmBackward0::apply("
      "std::vector<at::Tensor>&&)"),
    F("engine.cpp", 1100, "torch::autograd::Engine::evaluate_function(...)"),
    F("engine.cpp", 600, "torch::autograd::Engine::thread_main(...)"),
    F("??", 0, "start_thread"),
    F("??", 0, "clone"),
]


def _snapshot(tmp_path=None):
    ev = [{"action": "alloc", "addr": 0x100000 * (k + 1), "size": (4 - k) << 20,
           "frames": fr, "time_us": k + 1}
          for k, fr in enumerate((FORWARD, BACKWARD, LIBRARY_ONLY))]
    data = {"segments": [], "device_traces": [ev]}
    if tmp_path is None:
        return Snapshot(data, "all.pickle")
    f = tmp_path / "all.pickle"
    f.write_bytes(pickle.dumps(data))
    return open_snapshot(f)


def _ft(f):
    return (f["filename"], f["line"], f["name"])


def test_filter_matches_bare_file_names_and_hides_start_up_frames():
    for fr in (F("RegisterCUDA_0.cpp", 4302, "at::(anonymous namespace)::wrapper_CUDA_addmm"),
               F("RedispatchFunctions.cpp", 10, "at::redispatch::addmm"),
               F("??", 0, "PyCMethod_New"), F("main.c", 700, "Py_RunMain"),
               F("??", 0, "__libc_init_first"), F("??", 0, "_start"),
               F("??", 0, "_PyObject_MakeTpCall"), F("??", 0, "start_thread")):
        assert not is_shown_frame(_ft(fr)), fr
    # what names the op and its node stays
    for fr in (F("Operators_2.cpp", 1000, "at::_ops::addmm::call(...)"),
               F("Functions.cpp", 2100, "torch::autograd::generated::MmBackward0::apply()"),
               F("python_nn_functions.cpp", 2500, "torch::autograd::THPVariable_linear")):
        assert is_shown_frame(_ft(fr)), fr


def test_every_group_at_the_peak_opens_with_python_where_it_has_one(tmp_path):
    snap = _snapshot(tmp_path)
    tr = snap.trace()
    s = json.loads(report.summary_json(report.summary(snap)))
    d = s["dominated_by"]
    assert d["largest_stack"][0].endswith("model.py:42 forward")
    assert d["largest_call"][:3] == [
        "/home/u/proj/model.py:42 forward", f"{MODULE}:1750 _call_impl",
        f"{LINEAR}:125 forward"]   # the user's frame, then the library frames it called
    for g in tr.groups_at(tr.peak_index):
        fid = tr.el_fid[g.elements[0]]
        has_py = any(f[0].endswith(".py") for f in tr.frames(fid))
        gd = report._group_dict(tr, g)
        first = gd["largest_stack"][0]
        assert first.split(":")[0].endswith(".py") == has_py, (g.key, first)
        assert not any(x in " ".join(gd["largest_stack"]) for x in
                       ("PyCMethod_New", "Py_RunMain", "__libc_init_first", "RegisterCUDA_0",
                        "unwind", "_start"))
    lib = next(g for g in tr.groups_at(tr.peak_index) if "linear.py" in g.key)
    assert report._group_dict(tr, lib)["largest_stack"][0].endswith("linear.py:125 forward")


def test_stack_pane_and_html_show_python_first_and_fold_cpp(tmp_path):
    from gpumon.tui.view.frame import stack_lines
    snap = _snapshot(tmp_path)
    tr = snap.trace()
    g = tr.groups_at(tr.peak_index)[0]
    lines = stack_lines(tr, "group", g)
    assert lines[2] == "/home/u/proj/model.py:42 forward"   # after the group line and size
    assert any(ln.startswith("+ ") and "C++ frames" in ln and "(f shows them)" in ln
               for ln in lines)
    assert len(lines) < 14  # fits the pane at 80x24 with the C++ folded
    assert "  -> torch/nn/modules/linear.py:125 forward" in lines   # from the package on
    assert not any("_call_impl" in ln for ln in lines)   # nn.Module's call plumbing left out
    full = stack_lines(tr, "group", g, full=True)
    assert any("RegisterCUDA_0.cpp" in ln for ln in full)
    page = report.html_page(snap)
    row = page[page.index("<td>model.py:42 forward</td>"):]
    row = row[:row.index("</tr>")]
    assert row.index("model.py:42 forward", 30) < row.index("linear.py:125")
    assert "RegisterCUDA" not in row and "unwind" not in row


def test_oom_failing_call_opens_with_the_users_frame():
    ev = [{"action": "alloc", "addr": 0x1000, "size": 1 << 20, "frames": FORWARD, "time_us": 1},
          {"action": "oom", "addr": 0, "size": 1 << 40, "frames": FORWARD, "time_us": 2}]
    snap = Snapshot({"segments": [], "device_traces": [ev]}, "oom.pickle")
    o = report.oom_info(snap)
    assert o["call"][0] == "/home/u/proj/model.py:42 forward"
    assert o["stack"][0] == "/home/u/proj/model.py:42 forward"
    assert "failing call: /home/u/proj/model.py:42 forward" in report.summary_text(
        report.summary(snap))
