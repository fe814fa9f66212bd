"""The faults issue 18 found on real H200 snapshots, each pinned by a test that failed before the
fix: the blank HTML chart, the C++ unwinder frames that named whole groups, fragmentation that
counted empty cached segments, an OOM verdict that took reserved + free for the device's
capacity, stackless allocations labelled as autograd's, and the missing reserved timeline."""
import html as htmlmod
import os
import pickle
import re
import shutil
import struct
import subprocess
import zlib

import pytest

from gpumon.snapshot import Snapshot
from gpumon.snapshot import report
from gpumon.snapshot.analysis import NO_PY_STACK, fmt_bytes
from gpumon.snapshot.synth import SynthAllocator, _stack, training_snapshot

# -- a stacks='all' trace: the frames torch's combined unwinder records (innermost first) --------
UNWIND = [
    {"filename": "??", "line": 0, "name": "torch::unwind::unwind()"},
    {"filename": "??", "line": 0, "name": "torch::CapturedTraceback::gather(bool, bool, bool)"},
    {"filename": "??", "line": 0, "name": "c10::cuda::CUDACachingAllocator::Native::"
                                          "DeviceCachingAllocator::malloc(signed char, unsigned "
                                          "long, CUstream_st*)"},
    {"filename": "??", "line": 0, "name": "c10::cuda::CUDACachingAllocator::Native::"
                                          "NativeCachingAllocator::allocate(unsigned long)"},
    {"filename": "??", "line": 0, "name": "at::detail::empty_generic(c10::ArrayRef<long>, "
                                          "c10::Allocator*, c10::DispatchKeySet, "
                                          "c10::ScalarType, std::optional<c10::MemoryFormat>)"},
    {"filename": "??", "line": 0, "name": "at::native::empty_cuda(...)"},
    {"filename": "??", "line": 0, "name": "at::(anonymous namespace)::create_out(...)"},
    {"filename": "??", "line": 0, "name": "c10::impl::wrap_kernel_functor_unboxed_<...>::call"},
]
BACKWARD = UNWIND + [
    {"filename": "??", "line": 0, "name": "at::_ops::mm::call(at::Tensor const&, "
                                          "at::Tensor const&)"},
    {"filename": "??", "line": 0, "name": "torch::autograd::generated::details::"
                                          "mm_mat2_backward(...)"},
    {"filename": "??", "line": 0, "name": "torch::autograd::generated::MmBackward0::apply("
                                          "std::vector<at::Tensor>&&)"},
    {"filename": "??", "line": 0, "name": "torch::autograd::Node::operator()(...)"},
    {"filename": "??", "line": 0, "name": "torch::autograd::Engine::evaluate_function(...)"},
    {"filename": "??", "line": 0, "name": "torch::autograd::Engine::thread_main(...)"},
    {"filename": "??", "line": 0, "name": "start_thread"},
    {"filename": "??", "line": 0, "name": "clone"},
]
CPP_ONLY = UNWIND + [
    {"filename": "??", "line": 0, "name": "at::_ops::empty_strided::call(...)"},
    {"filename": "??", "line": 0, "name": "at::_ops::add_Tensor::call(...)"},
    {"filename": "??", "line": 0, "name": "c10d::Reducer::run_comm_hook(...)"},
]
FORWARD = UNWIND + [
    {"filename": "??", "line": 0, "name": "at::_ops::addmm::call(...)"},
    {"filename": "??", "line": 0, "name": "_PyEval_EvalFrameDefault"},
    {"filename": "/usr/lib/python3/site-packages/torch/nn/modules/linear.py", "line": 125,
     "name": "forward"},
    {"filename": "/home/u/proj/model.py", "line": 42, "name": "forward"},
    {"filename": "??", "line": 0, "name": "PyObject_Call"},
    {"filename": "/home/u/proj/train.py", "line": 7, "name": "main"},
]


def _all_stacks_snapshot(oom: bool = False):
    ev = [
        {"action": "alloc", "addr": 0x1000, "size": 3 << 20, "frames": BACKWARD, "time_us": 1},
        {"action": "alloc", "addr": 0x400000, "size": 1 << 20, "frames": FORWARD, "time_us": 2},
        {"action": "alloc", "addr": 0x600000, "size": 512 << 10, "frames": CPP_ONLY,
         "time_us": 3},
        {"action": "alloc", "addr": 0x700000, "size": 256 << 10, "frames": [], "time_us": 4},
    ]
    if oom:
        ev.append({"action": "oom", "size": 1 << 30, "device_free": 0, "frames": FORWARD,
                   "time_us": 5})
    blocks = [{"address": e["addr"], "size": e["size"], "requested_size": e["size"],
               "state": "active_allocated", "frames": e["frames"]} for e in ev[:4]]
    seg = {"device": 0, "address": 0x1000, "total_size": 8 << 20, "blocks": blocks}
    return Snapshot({"segments": [seg], "device_traces": [ev]}, "all.pickle")


def test_cpp_unwinder_frames_do_not_name_groups():
    tr = _all_stacks_snapshot().trace()
    keys = {g.key: g.bytes for g in tr.groups_at(3)}
    assert keys == {"<autograd MmBackward0>": 3 << 20, "model.py:42 forward": 1 << 20,
                    "<aten::add_Tensor>": 512 << 10, NO_PY_STACK: 256 << 10}
    assert not any("unwind" in k for k in keys)


def test_shown_stacks_drop_unwinder_and_allocator_frames_like_memory_viz():
    tr = _all_stacks_snapshot().trace()
    shown = tr.shown_frames(tr.fid[0])
    names = [f[2] for f in shown]
    assert names[0].startswith("at::detail::empty_generic")   # the first frame past the allocator
    assert not any("unwind" in n or "CapturedTraceback" in n or "CachingAllocator" in n
                   for n in names)
    assert "torch::autograd::generated::MmBackward0::apply(std::vector<at::Tensor>&&)" in names
    fwd = [f[2] for f in tr.shown_frames(tr.fid[1])]
    assert "_PyEval_EvalFrameDefault" not in fwd and "PyObject_Call" not in fwd
    assert fwd[-3:] == ["forward", "forward", "main"]


def test_json_and_oom_failing_call_open_with_the_callers_frames():
    snap = _all_stacks_snapshot(oom=True)
    s = report.summary(snap)
    by = {g["where"]: g for g in s["top_at_peak"]}
    assert "<autograd MmBackward0>" in by
    o = s["oom"]
    assert not any("unwind" in f or "CachingAllocator" in f for f in o["stack"])
    assert "model.py:42 forward" in " ".join(o["call"][:4])
    # Python first (issue 33): the user's frame opens the failing call, the C++ op after
    assert o["call"][0] == "/home/u/proj/model.py:42 forward"
    assert o["stack"][3] == "??:0 at::_ops::addmm::call(...)"
    top = {g["where"]: g for g in o["top"]}
    assert not top["<autograd MmBackward0>"]["largest_stack"][0].startswith("??:0 torch::unwind")
    txt = report.summary_text(s)
    failing = [ln for ln in txt.splitlines() if "failing call:" in ln][0]
    assert "unwind" not in failing and "model.py:42 forward" in failing


def test_stackless_allocations_are_not_blamed_on_autograd():
    assert "autograd" not in NO_PY_STACK and "backward" not in NO_PY_STACK


# -- fragmentation -------------------------------------------------------------------------
def _seg(addr, blocks):
    out, a = [], addr
    for size, state in blocks:
        out.append({"address": a, "size": size, "requested_size": size if state != "inactive"
                    else 0, "state": state, "frames": []})
        a += size
    return {"device": 0, "address": addr, "total_size": a - addr, "segment_type": "large",
            "blocks": out}


def test_empty_cached_segments_are_cache_not_fragmentation():
    mb = 1 << 20
    segs = [_seg(0, [(18 * mb, "active_allocated"), (2 * mb, "inactive")])]
    segs += [_seg((k + 1) << 30, [(20 * mb, "inactive")]) for k in range(40)]
    t = Snapshot({"segments": segs, "device_traces": []}).trace().segment_totals()
    assert t["empty_segments"] == 40 and t["empty_segments_bytes"] == 800 * mb
    assert t["free_in_used_segments"] == 2 * mb
    assert t["fragmentation"] == pytest.approx(0.1)   # was 1 - 20/802 = 97.5%
    txt = report.summary_text(report.summary(Snapshot({"segments": segs, "device_traces": []})))
    assert "empty_cache()" in txt and "fragmentation   10%" in txt


def test_holes_between_live_blocks_are_fragmentation():
    mb = 1 << 20
    segs = [_seg(0, [(2 * mb, "active_allocated"), (2 * mb, "inactive")] * 5)]
    t = Snapshot({"segments": segs, "device_traces": []}).trace().segment_totals()
    assert t["empty_segments"] == 0 and t["fragmentation"] == pytest.approx(0.5)


# -- the OOM verdict -------------------------------------------------------------------------
def _oom_snapshot(requested, device_free, reserved_mb=5000):
    mb = 1 << 20
    segs = [_seg(0, [(reserved_mb * mb - 100 * mb, "active_allocated"), (100 * mb, "inactive")])]
    ev = [{"action": "oom", "size": requested, "device_free": device_free, "time_us": 1,
           "frames": _stack("/p/train.py", 9, "step", "matmul")}]
    return {"segments": segs, "device_traces": [ev]}


def test_oom_without_device_total_never_calls_reserved_plus_free_the_device():
    data = _oom_snapshot(8 << 30, 150 << 20)
    o = report.oom_info(Snapshot(data, "o.pickle"))
    assert o["kind"] == "huge"
    assert "whole device" not in o["verdict"]
    assert "not in the file" in o["verdict"]


def test_oom_with_device_total_from_the_sidecar_uses_it():
    data = _oom_snapshot(8 << 30, 150 << 20)
    o = report.oom_info(Snapshot(data, "o.pickle", {"oom": {"device_total": 80 << 30}}))
    # 8 GiB of an 80 GiB device: not a huge request, the device is full
    assert o["kind"] == "full" and "whole device" not in o["verdict"]
    o = report.oom_info(Snapshot(_oom_snapshot(100 << 30, 150 << 20), "o.pickle",
                                 {"oom": {"device_total": 80 << 30}}))
    assert o["kind"] == "huge" and "whole device (80.00 GiB)" in o["verdict"]


# -- reserved over time -------------------------------------------------------------------
@pytest.mark.parametrize("keep", [None, 40])
def test_reserved_timeline_and_peak_reserved_match_the_allocator(keep):
    al = SynthAllocator(capacity=200 << 20)
    fr = _stack("/p/m.py", 1, "f", "empty")
    al.recording = False
    kept = [al.malloc(30 << 20, fr)]
    al.recording = True
    ptrs = [al.malloc((k % 5 + 1) << 20, fr) for k in range(30)]
    big = al.malloc(60 << 20, fr)
    for p in ptrs[::2] + [big]:
        al.free(p)
    al.release_cached()
    ptrs2 = [al.malloc(25 << 20, fr) for _ in range(3)]
    data, _ = al.snapshot(keep)
    rtruth = al.rtruth[-keep:] if keep else al.rtruth
    tr = Snapshot(pickle.loads(pickle.dumps(data))).trace()
    assert list(tr.reserved) == rtruth
    assert tr.peak_reserved[0] == max(rtruth)
    s = report.summary(Snapshot(data))
    assert s["peak_reserved"]["bytes"] == max(rtruth)
    assert f"peak reserved   {fmt_bytes(max(rtruth))}" in report.summary_text(s)
    assert kept and ptrs2


# -- the HTML chart ------------------------------------------------------------------------
def _page(**kw):
    data, truth = training_snapshot(steps=3, layers=4, **kw)
    snap = Snapshot(pickle.loads(pickle.dumps(data)), "train.pickle")
    return snap, report.html_page(snap, cols=200)


def _points(page, tag, ident):
    m = re.search(rf'<{tag} id="{ident}" points="([^"]+)"', page)
    assert m, f"no {tag}#{ident} in the page"
    return [tuple(map(float, p.split(","))) for p in m.group(1).split()]


def test_html_chart_points_follow_the_timeline():
    snap, page = _page()
    tr = snap.trace()
    assert '{"".join(parts)}' not in page
    dec = tr.decimate(0, tr.n, 200)
    rdec = tr.decimate_series(tr.reserved, 0, tr.n, 200)
    ymax = max(mx for _, mx in dec + rdec)
    pts = _points(page, "polygon", "allocated")
    # a step function (issue 33: it ramped between columns): each column flat at its max
    assert len(pts) == 2 * len(dec) + 2
    W, H, L, B = 1100, 340, 80, 48
    for c, (mn, mx) in enumerate(dec):  # the top edge: each column's max, across the column
        (x0, y0), (x1, y1) = pts[2 * c], pts[2 * c + 1]
        assert x0 == pytest.approx(L + (W - L - 10) * c / len(dec), abs=0.06)
        assert x1 == pytest.approx(L + (W - L - 10) * (c + 1) / len(dec), abs=0.06)
        assert y0 == y1 == pytest.approx(H - B - (H - B - 10) * mx / ymax, abs=0.06)
    assert pts[-2:] == [(W - 10, H - B), (L, H - B)]   # closed along the zero line
    # the highest point of the area is the peak
    top = min(y for _, y in pts)
    assert top == pytest.approx(H - B - (H - B - 10) * tr.peak / ymax, abs=0.06)
    res = _points(page, "polyline", "reserved")
    assert min(y for _, y in res) == pytest.approx(
        H - B - (H - B - 10) * tr.peak_reserved[0] / ymax, abs=0.06)


def test_html_peak_mark_and_value():
    snap, page = _page()
    tr = snap.trace()
    m = re.search(r'<line id="peak" x1="([\d.]+)"[^>]*data-event="(\d+)" data-bytes="(\d+)"',
                  page)
    assert m and int(m.group(2)) == tr.peak_index and int(m.group(3)) == tr.peak
    assert float(m.group(1)) == pytest.approx(80 + 1010 * (tr.peak_index + 0.5) / tr.n, abs=0.06)
    label = re.search(r'<text id="peak-label"[^>]*>([^<]+)</text>', page).group(1)
    assert htmlmod.unescape(label) == f"peak {fmt_bytes(tr.peak)}"
    label = re.search(r'<text id="peak-reserved-label"[^>]*>([^<]+)</text>', page).group(1)
    assert htmlmod.unescape(label) == f"peak reserved {fmt_bytes(tr.peak_reserved[0])}"


# -- the page in a real browser -------------------------------------------------------------
def _chromium():
    for name in ("chromium", "chromium-browser", "google-chrome", "chrome"):
        p = shutil.which(name)
        if p:
            return p
    return None


def _png_pixels(data: bytes):
    """(width, height, rows of RGB(A) bytes) of a PNG (8-bit RGB or RGBA, as Chromium writes)."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, w, h, bpp = 8, [], 0, 0, 3
    while pos < len(data):
        n, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + n]
        if kind == b"IHDR":
            w, h, depth, ctype = struct.unpack(">IIBB", body[:10])
            assert depth == 8 and ctype in (2, 6)
            bpp = 3 if ctype == 2 else 4
        elif kind == b"IDAT":
            idat.append(body)
        pos += 12 + n
    raw = zlib.decompress(b"".join(idat))
    stride = w * bpp
    rows, prev, i = [], bytearray(stride), 0
    for _ in range(h):
        f, line = raw[i], bytearray(raw[i + 1:i + 1 + stride])
        i += 1 + stride
        for x in range(stride):
            a = line[x - bpp] if x >= bpp else 0
            b = prev[x]
            c = prev[x - bpp] if x >= bpp else 0
            if f == 1:
                line[x] = (line[x] + a) & 255
            elif f == 2:
                line[x] = (line[x] + b) & 255
            elif f == 3:
                line[x] = (line[x] + (a + b) // 2) & 255
            elif f == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[x] = (line[x] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        rows.append(bytes(line))
        prev = line
    return w, h, bpp, rows


def test_html_chart_renders_in_a_headless_browser(tmp_path):
    exe = _chromium()
    if exe is None:
        pytest.skip("no chromium on this machine (apt-get install chromium) to render the page")
    snap, page = _page()
    f = tmp_path / "page.html"
    f.write_text(page)
    png = tmp_path / "shot.png"
    try:
        r = subprocess.run([exe, "--headless", "--no-sandbox", "--disable-gpu",
                            "--hide-scrollbars", "--window-size=1000,560",
                            f"--screenshot={png}", f.as_uri()],
                           capture_output=True, text=True, timeout=60,
                           env={**os.environ, "HOME": str(tmp_path)})
    except (OSError, subprocess.TimeoutExpired) as e:
        pytest.skip(f"chromium could not run here: {e}")
    if not png.exists():
        pytest.skip(f"chromium wrote no screenshot (rc {r.returncode}): {r.stderr[-300:]}")
    w, h, bpp, rows = _png_pixels(png.read_bytes())

    def where(rgb, tol=12):
        near = {(r, g, b) for r in range(rgb[0] - tol, rgb[0] + tol + 1)
                for g in range(rgb[1] - tol, rgb[1] + tol + 1)
                for b in range(rgb[2] - tol, rgb[2] + tol + 1)}
        out = []
        for y, row in enumerate(rows):
            px = zip(row[0::bpp], row[1::bpp], row[2::bpp])
            out += [(x, y) for x, p in enumerate(px) if p in near]
        return out
    blue = where((0x4E, 0x79, 0xA7))
    red = where((0xE1, 0x57, 0x59))
    orange = where((0xF2, 0x8E, 0x2B))
    # the area chart is drawn: thousands of pixels in the series colour, spread over the plot
    assert len(blue) > 20000, len(blue)
    xs = [x for x, _ in blue]
    assert max(xs) - min(xs) > 0.7 * w
    assert red and orange
    # the peak's red mark stands where the area is highest
    tr = snap.trace()
    top_y = min(y for _, y in blue)
    top_x = [x for x, y in blue if y <= top_y + 1]
    peak_x = [x for x, _ in red]
    frac = tr.peak_index / (tr.n - 1)
    svg_left, svg_right = min(xs), max(xs)
    expect = svg_left + (svg_right - svg_left) * frac
    assert min(abs(x - expect) for x in peak_x) < 0.02 * w
    assert min(abs(x - expect) for x in top_x) < 0.03 * w


# -- stacks='all' files: a fresh frame list per event --------------------------------------
def test_all_stacks_file_groups_as_the_python_one_and_interns_stacks(tmp_path):
    from gpumon.snapshot import open_snapshot
    py, _ = training_snapshot(steps=3, layers=4, seed=5)
    al, _ = training_snapshot(steps=3, layers=4, seed=5, all_stacks=True)
    f = tmp_path / "all.pickle"
    f.write_bytes(pickle.dumps(al, protocol=4))
    a = open_snapshot(f).trace()
    p = Snapshot(py).trace()
    assert a.n == p.n and list(a.allocated) == list(p.allocated)
    key = lambda gs: [(g.key, g.bytes, g.count) for g in gs]  # noqa: E731
    assert key(a.groups_at(a.peak_index)) == key(p.groups_at(p.peak_index))
    # one table entry per distinct stack, though every event has its own list
    assert len(a.frames_table) == len(p.frames_table) < a.n // 5
    fr = a.shown_frames(a.fid[a.peak_index])
    assert fr[0][2].startswith("at::") and not any("PyEval" in f[2] for f in fr)
