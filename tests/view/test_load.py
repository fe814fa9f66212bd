"""Safe loading: hostile pickles are refused without running anything; broken files get one line."""
import gzip
import os
import pickle
import pickletools  # noqa: F401  (documents the opcodes used below)

import pytest

from gpumon.snapshot import SnapshotError, load_snapshot, open_snapshot
from gpumon.snapshot.synth import training_snapshot


@pytest.fixture
def snap_file(tmp_path):
    snap, _ = training_snapshot(steps=2, layers=3)
    p = tmp_path / "ok.pickle"
    p.write_bytes(pickle.dumps(snap))
    return p


def _one_line(e: Exception) -> str:
    msg = str(e)
    assert msg and "\n" not in msg
    return msg


class _Reduce:
    def __init__(self, cmd):
        self.cmd = cmd

    def __reduce__(self):
        return (os.system, (self.cmd,))


def _hostile_payloads(marker: str) -> dict[str, bytes]:
    cmd = f"touch {marker}"
    proto0_global = (b"cos\nsystem\n(S'" + cmd.encode() + b"'\ntR.")
    inst = b"(S'" + cmd.encode() + b"'\nios\nsystem\n."
    stack_global = (b"\x80\x04\x8c\x02os\x94\x8c\x06system\x94\x93\x94\x8c" +
                    bytes([len(cmd)]) + cmd.encode() + b"\x94\x85\x94R\x94.")
    wrapped = pickle.dumps({"segments": [], "device_traces": [[{"action": "alloc",
                                                               "frames": _Reduce(cmd)}]]})
    return {
        "reduce_object": pickle.dumps(_Reduce(cmd)),
        "reduce_inside_snapshot": wrapped,
        "global_proto0": proto0_global,
        "inst": inst,
        "stack_global": stack_global,
        "builtins_eval": pickle.dumps(eval) + b"",  # a pickled function reference
        "persistent_id": b"\x80\x02P1\n.",
        "ext1": b"\x80\x02\x82\x01.",
    }


@pytest.mark.parametrize("name", list(_hostile_payloads("x")))
def test_hostile_pickle_refused_and_never_run(tmp_path, name):
    marker = tmp_path / "PWNED"
    data = _hostile_payloads(str(marker))[name]
    p = tmp_path / f"{name}.pickle"
    p.write_bytes(data)
    with pytest.raises(SnapshotError) as ei:
        load_snapshot(p)
    msg = _one_line(ei.value)
    assert "refused" in msg or "corrupt" in msg
    assert not marker.exists(), "the payload ran"


def test_refusal_names_the_object(tmp_path):
    p = tmp_path / "h.pickle"
    p.write_bytes(pickle.dumps(_Reduce("true")))
    with pytest.raises(SnapshotError, match=r"refused: .*(posix|os)\.system"):
        load_snapshot(p)


def test_loads_a_real_format_snapshot(snap_file):
    s = open_snapshot(snap_file)
    assert s.trace().n > 0 and s.data["segments"]


def test_gzip_snapshot(tmp_path, snap_file):
    gz = tmp_path / "ok.pickle.gz"
    gz.write_bytes(gzip.compress(snap_file.read_bytes()))
    assert open_snapshot(gz).trace().n == open_snapshot(snap_file).trace().n


@pytest.mark.parametrize("content,needle", [
    (b"", "empty"),
    (b"hello world, not a pickle", "not a pickle"),
    (b"\x89PNG\r\n\x1a\n....", "not a pickle"),
    (b"\x80\x04\x95\xff\xff\x00\x00\x00\x00\x00\x00}\x94(\x8c", "truncated"),
    (b"\x80\x04K\x01.", "not a memory snapshot"),            # the int 1
    (pickle.dumps({"a": 1}), "not a memory snapshot"),
    (pickle.dumps({"segments": 3, "device_traces": []}), "segments"),
    (pickle.dumps({"segments": [], "device_traces": [1]}), "device_traces"),
    (b"\x80\x04\x95garbage-after-frame-bytes", "corrupt"),
])
def test_broken_files_one_line(tmp_path, content, needle):
    p = tmp_path / "bad.pickle"
    p.write_bytes(content)
    with pytest.raises(SnapshotError) as ei:
        load_snapshot(p)
    assert needle in _one_line(ei.value)


def test_truncated_real_snapshot(tmp_path, snap_file):
    data = snap_file.read_bytes()
    for cut in (1, len(data) // 3, len(data) - 1):
        p = tmp_path / f"cut{cut}.pickle"
        p.write_bytes(data[:cut])
        with pytest.raises(SnapshotError) as ei:
            load_snapshot(p)
        _one_line(ei.value)


def test_corrupt_gzip(tmp_path, snap_file):
    p = tmp_path / "bad.gz"
    p.write_bytes(gzip.compress(snap_file.read_bytes())[:200])
    with pytest.raises(SnapshotError) as ei:
        load_snapshot(p)
    _one_line(ei.value)


def test_huge_nesting(tmp_path):
    p = tmp_path / "deep.pickle"
    p.write_bytes(b"\x80\x02" + b"]" * 200_000 + b"a" * 199_999 + b".")
    with pytest.raises(SnapshotError) as ei:
        load_snapshot(p)
    _one_line(ei.value)


def test_size_guard(tmp_path, snap_file, monkeypatch):
    with pytest.raises(SnapshotError, match="limit"):
        load_snapshot(snap_file, max_bytes=100)
    monkeypatch.setenv("GPUMON_VIEW_MAX_BYTES", "100")
    with pytest.raises(SnapshotError, match="GPUMON_VIEW_MAX_BYTES"):
        load_snapshot(snap_file)


def test_gzip_bomb_guard(tmp_path):
    p = tmp_path / "bomb.gz"
    p.write_bytes(gzip.compress(b"\x80\x04" + b"N" * 5_000_000))
    with pytest.raises(SnapshotError, match="limit"):
        load_snapshot(p, max_bytes=1_000_000)


def test_missing_and_directory(tmp_path):
    with pytest.raises(SnapshotError, match="no such file"):
        load_snapshot(tmp_path / "nope.pickle")
    with pytest.raises(SnapshotError, match="directory"):
        load_snapshot(tmp_path)


def test_segments_only_list(tmp_path):
    snap, _ = training_snapshot(steps=1, layers=2)
    p = tmp_path / "segs.pickle"
    p.write_bytes(pickle.dumps(snap["segments"]))
    s = open_snapshot(p)
    assert s.trace().n == 0 and s.trace().base > 0
