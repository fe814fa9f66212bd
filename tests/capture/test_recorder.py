"""The recorder's logic against a fake of torch's recording API (no CUDA here)."""
from __future__ import annotations

import errno
import io
import json
import os
import pickle
import sys
import types

import pytest

from gpumon.agent import snapshot as snap
from tests.capture.fakes import Events, FakeMemoryAPI


@pytest.fixture
def api():
    return FakeMemoryAPI()


@pytest.fixture
def events():
    return Events()


@pytest.fixture
def rec(api, events, tmp_path):
    return snap.Recorder(None, backend=api, broadcast=events, pid=4242, cwd=str(tmp_path),
                         start_time=1_700_000_000.0, rank=None)


def files(d):
    return sorted(p.name for p in d.rglob("*") if p.is_file())


def test_start_stop_writes_plain_torch_pickle_and_sidecar(rec, api, events, tmp_path):
    r = rec.start({"stacks": "all", "max_entries": 500}, "pid:1")
    assert r["recording"] and r["by"] == "pid:1" and not r["user_recording"]
    assert api.calls == [("start", "all", 500)]
    api.alloc(4096)
    api.alloc(8192)
    facts = rec.stop({}, "pid:2")
    assert api.calls[-1] == ("stop",) and not api.recording
    path = facts["path"]
    assert path.startswith(str(tmp_path / "gpumon-snapshots" / "4242-"))
    assert os.path.basename(path).startswith("snapshot-1-") and path.endswith(".pickle")
    with open(path, "rb") as f:  # exactly what _dump_snapshot writes: a pickle of the dict
        data = pickle.load(f)
    assert [e["size"] for e in data["device_traces"][0]] == [4096, 8192]
    assert set(data) == {"segments", "device_traces", "allocator_settings",
                         "external_annotations"}  # nothing of ours inside: memory_viz reads it
    assert facts["entries"] == 2 and facts["size"] == os.path.getsize(path)
    meta = json.loads(open(path + ".json").read())
    assert meta["format"] == "gpumon-snapshot-meta" and meta["kind"] == "manual"
    assert meta["stacks"] == "all" and meta["max_entries"] == 500 and meta["entries"] == 2
    assert meta["oom"] is None and meta["simulated"] is False and meta["pid"] == 4242
    # no temp files left behind
    assert files(tmp_path) == sorted([os.path.basename(path), os.path.basename(path) + ".json"])
    started = events.of("recording")[0]
    assert started["state"] == "started" and started["by"] == "pid:1"
    stopped = events.of("recording")[1]
    assert stopped["state"] == "stopped" and stopped["by"] == "pid:2"
    assert stopped["path"] == path and stopped["reason"] == "stop"
    assert events.of("snapshot")[0]["path"] == path


def test_loads_with_the_view_parts_restricted_unpickler(rec, api):
    rec.start({}, "c")
    api.alloc(512)
    path = rec.stop({}, "c")["path"]
    from gpumon.snapshot import load
    data = load.loads_plain(open(path, "rb").read())
    assert data["device_traces"][0][0]["size"] == 512


def test_second_client_is_told_who_and_since(rec, api):
    rec.start({"who": "gpumon attach (alice)"}, "pid:10")
    with pytest.raises(snap.SnapshotError) as e:
        rec.start({}, "pid:11")
    msg = str(e.value)
    assert "already recording" in msg and "gpumon attach (alice)" in msg and " at " in msg
    assert "s ago" in msg
    st = rec.status()
    assert st["recording"] and st["by"] == "pid:10" and st["who"] == "gpumon attach (alice)"
    assert st["since"] is not None and st["elapsed"] >= 0


def test_user_recording_is_left_on(rec, api):
    api.recording = True  # the program called _record_memory_history itself
    api.alloc(100)
    r = rec.start({}, "c")
    assert r["user_recording"] and "already on" in r["note"]
    assert api.calls == []  # its settings untouched
    facts = rec.stop({}, "c")
    assert api.recording and ("stop",) not in api.calls
    assert facts["entries"] == 1
    assert json.loads(open(facts["path"] + ".json").read())["user_recording"] is True


def test_stop_without_recording_is_a_clear_error(rec):
    with pytest.raises(snap.SnapshotError, match="not recording"):
        rec.stop({}, "c")


@pytest.mark.parametrize("args, match", [
    ({"stacks": "cpp"}, "stacks"), ({"max_entries": 0}, "max_entries"),
    ({"max_entries": "lots"}, "max_entries"), ({"seconds": -1}, "seconds"),
    ({"steps": 2.5}, "steps"), ({"seconds": 1, "steps": 1}, "not both"),
])
def test_bad_arguments(rec, api, args, match):
    with pytest.raises(snap.SnapshotError, match=match):
        rec.start(args, "c")
    assert not api.recording and rec.session is None


def test_unavailable_reason_is_the_error(rec, api):
    api.unavailable_reason = "the allocator backend is cudaMallocAsync"
    with pytest.raises(snap.SnapshotError, match="cudaMallocAsync"):
        rec.start({}, "c")
    assert api.calls == []


def test_seconds_stop_condition(rec, api, events):
    rec.start({"seconds": 0.2}, "c")
    api.alloc(1)
    ev = events.wait("snapshot")[0]
    assert ev["ok"] and ev["reason"] == "seconds" and os.path.exists(ev["path"])
    assert not api.recording and rec.session is None


def test_steps_stop_condition_counts_one_optimizer_and_removes_the_hook(rec, api, events):
    rec.start({"steps": 3}, "c")
    assert len(api.step_hooks) == 1
    api.step("adam")
    api.step("adam")
    api.step("other")   # a second optimizer (a GAN's) does not count
    assert events.of("snapshot") == []
    assert rec.status()["steps_done"] == 2
    api.step("adam")
    ev = events.wait("snapshot")[0]
    assert ev["reason"] == "steps" and ev["steps"] == 3
    assert api.step_hooks == []  # removed afterwards
    assert not api.recording


def test_steps_hook_never_raises(rec, api):
    rec.start({"steps": 2}, "c")
    s = rec.session
    rec._on_step(None, "x")  # a broken session object: swallowed
    rec._on_step(s, object())


class _FullFile(io.BufferedWriter):
    """A file on a disk that fills up after `room` bytes."""

    def __init__(self, raw, room):
        super().__init__(raw)
        self.room = room

    def write(self, b):
        if len(b) > self.room:
            raise OSError(errno.ENOSPC, "No space left on device")
        self.room -= len(b)
        return super().write(b)


def test_disk_full_leaves_no_file_and_keeps_recording(rec, api, events, tmp_path, monkeypatch):
    rec.start({}, "c")
    for _ in range(50):
        api.alloc(1 << 20, frames=[{"filename": "x" * 200, "line": 1, "name": "f"}])
    real_fdopen = os.fdopen
    monkeypatch.setattr(snap.os, "fdopen",
                        lambda fd, mode="r", *a, **k: _FullFile(io.FileIO(fd, "w"), 3000))
    with pytest.raises(snap.SnapshotError) as e:
        rec.stop({}, "c")
    assert "disk full" in str(e.value) and "still recording" in str(e.value)
    run_dir = tmp_path / "gpumon-snapshots"
    assert [p for p in run_dir.rglob("*") if p.is_file()] == []  # nothing half-written
    assert api.recording and rec.session is not None  # nothing lost
    assert events.of("snapshot")[-1]["ok"] is False
    monkeypatch.setattr(snap.os, "fdopen", real_fdopen)
    out = tmp_path / "elsewhere.pickle"
    facts = rec.stop({"out": str(out)}, "c")  # the retry, to another place
    assert facts["path"] == str(out) and facts["entries"] == 50
    assert len(pickle.load(open(out, "rb"))["device_traces"][0]) == 50


def test_disk_full_on_a_real_tiny_filesystem(rec, api, tmp_path):
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    if os.geteuid() != 0 or os.system(f"mount -t tmpfs -o size=64k tmpfs {mnt} 2>/dev/null"):
        pytest.skip("needs root and tmpfs mounts")
    try:
        rec.start({}, "c")
        for _ in range(2000):
            api.alloc(512, frames=[{"filename": "f" * 100, "line": 1, "name": "g"}])
        with pytest.raises(snap.SnapshotError, match="disk full"):
            rec.stop({"out": str(mnt / "s.pickle")}, "c")
        assert os.listdir(mnt) == []
        assert api.recording
    finally:
        os.system(f"umount {mnt}")


def test_no_permission_for_an_explicit_out_fails_at_start(rec, api, tmp_path, monkeypatch):
    def deny(*a, **k):
        raise PermissionError(errno.EACCES, "Permission denied")
    monkeypatch.setattr(snap.tempfile, "mkstemp", deny)
    with pytest.raises(snap.SnapshotError, match="no permission"):
        rec.start({"out": str(tmp_path / "ro" / "x.pickle")}, "c")
    assert not api.recording  # failed before recording anything


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_no_permission_real_readonly_dir(rec, api, tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    with pytest.raises(snap.SnapshotError, match="no permission"):
        rec.start({"out": str(ro / "x.pickle")}, "c")


def test_default_dir_not_writable_falls_back_to_temp(rec, api, tmp_path, monkeypatch):
    real = snap._check_writable_dir
    bad = str(tmp_path / "gpumon-snapshots")

    def check(d, *private_base):
        if d.startswith(bad):
            raise PermissionError(errno.EACCES, "Permission denied")
        return real(d, *private_base)
    monkeypatch.setattr(snap, "_check_writable_dir", check)
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(snap.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    rec.start({}, "c")
    facts = rec.stop({}, "c")
    assert facts["path"].startswith(str(tmp_path / "tmp"))
    assert "no permission" in facts["note"] and "instead" in facts["note"]


def test_atomic_write_never_shows_a_partial_file(tmp_path):
    target = tmp_path / "s.pickle"
    target.write_bytes(b"old complete file")

    def boom(f):
        f.write(b"partial")
        raise OSError(errno.EIO, "I/O error")
    with pytest.raises(OSError):
        snap.write_atomic(str(target), boom)
    assert target.read_bytes() == b"old complete file"
    assert os.listdir(tmp_path) == ["s.pickle"]
    size = snap.write_atomic(str(target), lambda f: f.write(b"new"))
    assert size == 3 and target.read_bytes() == b"new"


def test_out_may_be_a_directory(rec, api, tmp_path):
    d = tmp_path / "mine"
    d.mkdir()
    rec.start({"out": str(d)}, "c")
    p = rec.stop({}, "c")["path"]
    assert os.path.dirname(p) == str(d)


def test_rank_and_simulated_in_the_name(api, events, tmp_path):
    r = snap.Recorder(None, backend=api, broadcast=events, pid=1, cwd=str(tmp_path), rank=3)
    r.start({}, "c")
    assert os.path.basename(r.stop({}, "c")["path"]).startswith("rank3-snapshot-")


def test_exit_mid_recording_dumps_and_tells(rec, api, events):
    rec.start({"seconds": 600}, "c")
    api.alloc(64)
    rec.at_exit()
    ev = events.wait("snapshot")[0]
    assert ev["reason"] == "exit" and os.path.exists(ev["path"])
    assert events.of("recording")[-1]["reason"] == "exit"
    assert rec.session is None


# ---- the OOM flight recorder ---------------------------------------------------------------

def test_oom_flight_recorder_dumps_at_the_oom(rec, api, events):
    api.cuda_ready = False
    rec.enable_oom()
    assert not api.recording  # waits for CUDA init (no context made by us)
    api.init_cuda()
    assert api.recording and api.calls == [("start", "python", snap.DEFAULT_MAX_ENTRIES)]
    assert len(api.observers) == 1
    api.alloc(1 << 20)
    api.oom(device=0, requested=10 << 40, total=80 << 30, free=3 << 30)
    ev = events.of("oom")[0]
    assert ev["requested"] == 10 << 40 and ev["free"] == 3 << 30 and ev["device"] == 0
    assert ev["allocated"] == api.allocated and ev["path"] and ev["error"] is None
    data = pickle.load(open(ev["path"], "rb"))
    assert data["device_traces"][0][-1]["action"] == "oom"
    meta = json.loads(open(ev["path"] + ".json").read())
    assert meta["kind"] == "oom"
    assert meta["oom"]["requested"] == 10 << 40 and meta["oom"]["device_total"] == 80 << 30
    assert meta["oom"]["device_free"] == 3 << 30 and meta["oom"]["allocated"] == api.allocated
    assert os.path.basename(ev["path"]).startswith("oom-")
    assert api.recording  # the flight recorder stays on


def test_oom_observer_is_a_noop_when_disabled_and_never_raises(rec, api, events):
    rec.hook_cuda()  # what install() does: attach the observer, recorder off
    assert len(api.observers) == 1 and not api.recording
    api.oom()
    assert events.of("oom")[0]["path"] is None and "off" in events.of("oom")[0]["error"]
    rec.enable_oom()
    api.fail_snapshot = RuntimeError("boom")
    api.oom()  # the snapshot fails: the observer still returns normally
    assert "boom" in events.of("oom")[1]["error"]
    rec._broadcast = lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt())
    api.oom()  # even a BaseException inside is swallowed


def test_oom_dump_limit(rec, api, events, monkeypatch):
    rec.oom_max_dumps = 2
    rec.enable_oom()
    for _ in range(4):
        api.oom()
    paths = [e["path"] for e in events.of("oom")]
    assert paths[0] and paths[1] and paths[2] is None and paths[3] is None
    assert "already wrote 2" in events.of("oom")[2]["error"]


def test_manual_snapshot_with_flight_recorder_keeps_it_on(rec, api):
    rec.enable_oom()
    r = rec.start({}, "c")
    assert not r["user_recording"] and "flight recorder" in r["note"]
    rec.stop({}, "c")
    assert api.recording and ("stop",) not in api.calls


def test_waits_for_torch_to_be_imported(api, events, tmp_path):
    class Late(FakeMemoryAPI):
        tries = 0

        def when_cuda_ready(self, fn):
            self.tries += 1
            if self.tries < 3:
                return False  # torch not imported yet
            return super().when_cuda_ready(fn)
    late = Late()
    r = snap.Recorder(None, backend=late, broadcast=events, pid=1, cwd=str(tmp_path))
    r.enable_oom()
    import time
    deadline = time.monotonic() + 20
    while not late.recording and time.monotonic() < deadline:
        time.sleep(0.02)
    assert late.recording and late.tries >= 3
    r._closed = True


def test_env_var_requests_the_recorder(monkeypatch):
    monkeypatch.setenv("GPUMON_OOM_SNAPSHOT", "1")
    assert snap.oom_snapshot_requested(None)
    monkeypatch.setenv("GPUMON_OOM_SNAPSHOT", "0")
    assert not snap.oom_snapshot_requested(None)
    assert snap.oom_snapshot_requested(types.SimpleNamespace(oom_snapshot=True))


# ---- the real torch backend, against fake torch modules shaped like each version ----------

def _fake_torch(monkeypatch, version="2.4.0", backend="native", history_flag=True,
                cuda_version="12.1", initialized=True):
    calls = []
    mem = types.SimpleNamespace()

    def record_2_1(enabled="all", context="all", stacks="all", max_entries=sys.maxsize,
                   device=None):  # the 2.1 .. 2.7 signature: nothing more accepted
        calls.append(dict(enabled=enabled, context=context, stacks=stacks,
                          max_entries=max_entries))
    mem._record_memory_history = record_2_1
    mem._snapshot = lambda: {"segments": [], "device_traces": [[{"action": "alloc"}]]}
    cuda = types.SimpleNamespace(
        memory=mem, is_available=lambda: True, is_initialized=lambda: initialized,
        get_allocator_backend=lambda: backend,
        memory_allocated=lambda d: 11, memory_reserved=lambda d: 22)
    C = types.SimpleNamespace()
    if history_flag:
        C._cuda_isHistoryEnabled = lambda: False
    torch = types.SimpleNamespace(__version__=version, cuda=cuda, _C=C,
                                  version=types.SimpleNamespace(cuda=cuda_version))
    monkeypatch.setitem(sys.modules, "torch", torch)
    monkeypatch.setitem(sys.modules, "torch.cuda", cuda)
    return torch, calls


def test_torch_backend_uses_arguments_valid_from_2_1(monkeypatch):
    torch, calls = _fake_torch(monkeypatch)
    b = snap.TorchBackend()
    assert b.unavailable() is None
    b.start("python", 1000)
    b.stop()
    assert calls == [dict(enabled="all", context="all", stacks="python", max_entries=1000),
                     dict(enabled=None, context="all", stacks="all", max_entries=sys.maxsize)]
    assert b.memory_figures(0) == {"allocated": 11, "reserved": 22}


def test_torch_backend_recording_state(monkeypatch):
    torch, _ = _fake_torch(monkeypatch)
    assert snap.TorchBackend().is_recording() is False  # _cuda_isHistoryEnabled
    torch, _ = _fake_torch(monkeypatch, history_flag=False)
    assert snap.TorchBackend().is_recording() is True  # fallback: a non-empty trace


@pytest.mark.parametrize("kw, match", [
    ({"version": "2.0.1"}, "too old"),
    ({"backend": "cudaMallocAsync"}, "cudaMallocAsync"),
    ({"cuda_version": None}, "CPU build"),
    ({"initialized": False}, "not used CUDA yet"),
])
def test_torch_backend_unavailable(monkeypatch, kw, match):
    _fake_torch(monkeypatch, **kw)
    assert match in snap.TorchBackend().unavailable()


def test_torch_backend_without_torch(monkeypatch):
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    assert "not imported torch" in snap.TorchBackend().unavailable()


def test_torch_backend_on_the_real_torch_without_a_gpu():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this test is for a machine without a GPU")
    why = snap.TorchBackend().unavailable()
    if torch.version.cuda is None:  # a CPU build (this machine's torch 2.13.0+cpu)
        assert "CPU build" in why
    else:  # a CUDA build with no GPU (the 2.11 CI leg: PyPI's torch 2.11.0+cu130): never initialised
        assert why == "the program has not used CUDA yet; start a snapshot once training runs"


def test_simulated_backend_writes_a_labelled_torch_format_snapshot(events, tmp_path):
    src = types.SimpleNamespace(kind="simulated", params=64 << 20, step_s=0.1, TOTAL=8 << 30)
    r = snap.Recorder(types.SimpleNamespace(source=src), broadcast=events, pid=7,
                      cwd=str(tmp_path))
    assert isinstance(r.backend, snap.SimulatedBackend)
    r.start({"max_entries": 2000}, "c")
    facts = r.stop({}, "c")
    assert facts["simulated"] and os.path.basename(facts["path"]).startswith("simulated-")
    data = pickle.load(open(facts["path"], "rb"))
    trace = data["device_traces"][0]
    assert 0 < len(trace) <= 2000 and {"alloc", "free_requested"} <= {e["action"] for e in trace}
    assert all(f["filename"].startswith("<simulated>/") for e in trace for f in e["frames"])
    assert json.loads(open(facts["path"] + ".json").read())["simulated"] is True


def test_simulated_snapshot_of_n_steps_holds_n_steps(events, tmp_path, monkeypatch):
    """`gpumon snapshot PID --steps 3` on the demo (the CPU loop steps faster than the scripted
    clock) wrote a file of 1 step: "after 0 of 1 optimizer steps". It holds the steps asked."""
    from gpumon.snapshot import Snapshot
    from gpumon.snapshot import report
    from tests.capture.fakes import Handle
    src = types.SimpleNamespace(kind="simulated", params=64 << 20, step_s=60.0, TOTAL=8 << 30)
    r = snap.Recorder(types.SimpleNamespace(source=src), broadcast=events, pid=7,
                      cwd=str(tmp_path))
    hooks: list = []
    monkeypatch.setattr(r.backend, "register_step_hook",
                        lambda fn: (hooks.append(fn), Handle(hooks, fn))[1])
    r.start({"steps": 3}, "c")
    for _ in range(3):
        for fn in list(hooks):
            fn("adam", (), {})
    ev = events.wait("snapshot")[0]
    assert ev["ok"] and ev["reason"] == "steps" and ev["steps"] == 3
    data = pickle.load(open(ev["path"], "rb"))
    s = report.summary(Snapshot(data, ev["path"]), None)
    assert s["steps"] == 3, s["steps"]


def test_flight_recorder_starts_inside_torch_lazy_init(monkeypatch, tmp_path, events):
    # torch.cuda runs _lazy_call's queue inside _lazy_init, while is_initialized() is still
    # False: the recorder must start there (before the program's first allocation).
    torch, calls = _fake_torch(monkeypatch, initialized=False)
    queued = []
    torch.cuda._lazy_call = lambda fn, **kw: queued.append(fn)
    observers = []
    torch._C._cuda_attach_out_of_memory_observer = observers.append
    r = snap.Recorder(None, backend=snap.TorchBackend(), broadcast=events, pid=1,
                      cwd=str(tmp_path))
    r.enable_oom()
    assert len(queued) == 1 and calls == []
    queued[0]()  # what _lazy_init does
    assert calls == [dict(enabled="all", context="all", stacks="python",
                          max_entries=snap.DEFAULT_MAX_ENTRIES)]
    assert observers == [r._on_oom] and r.flight_ours


def test_torch_half_imported_is_not_hooked_yet(monkeypatch):
    torch, _ = _fake_torch(monkeypatch)
    torch.cuda._lazy_call = lambda fn, **kw: fn()
    torch.__spec__ = types.SimpleNamespace(_initializing=True)
    assert snap.TorchBackend().when_cuda_ready(lambda: None) is False
    torch.__spec__._initializing = False
    assert snap.TorchBackend().when_cuda_ready(lambda: None) is True


def test_torch_backend_step_hook_fires_on_a_real_cpu_optimizer():
    # The fake backend can't catch torch's own module layout: torch.optim does not expose its
    # `optimizer` submodule as an attribute in every version (it failed on 2.11 on the GPU).
    torch = pytest.importorskip("torch")
    from gpumon.agent.snapshot import TorchBackend
    seen = []
    handle = TorchBackend().register_step_hook(lambda opt, *a, **k: seen.append(opt))
    try:
        p = torch.nn.Parameter(torch.ones(3))
        opt = torch.optim.SGD([p], lr=0.1)
        p.sum().backward()
        opt.step()
        assert seen == [opt]
    finally:
        handle.remove()
