"""Issue 22, item 8: `gpumon view` on hostile files. A 40 KB pickle of shared references ran
past 120 s and 6.7 GB; a gzip of zeros and a 1 GiB random file were read whole (2 GB) before
being refused; deeply nested frames gave a RecursionError. The loader bounds memory and time
relative to the file's size and says in one line why it stops. Each file is loaded in a fresh
process, which reports its peak memory."""
import gzip
import os
import pickle
import subprocess
import sys
import time

import pytest

from .harness import ROOT, gpumon, one_clear_line

LOAD = r'''
import resource, sys
from gpumon.snapshot import load
if len(sys.argv) > 2:
    load.RSS_MIN = int(sys.argv[2])
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    obj = load.load_snapshot(sys.argv[1])
    print("loaded")
except load.SnapshotError as e:
    print("refused:", e)
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)
'''


def load_in_child(path, *extra, timeout=60):
    """(the one line, peak memory grown by the load in KiB, seconds)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    t0 = time.monotonic()
    try:
        r = subprocess.run([sys.executable, "-c", LOAD, str(path), *map(str, extra)],
                           capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{path.name}: still loading after {timeout} s")
    assert r.returncode == 0 and not r.stderr, r.stderr[-2000:]
    line, grown = r.stdout.strip().splitlines()
    return line, int(grown), time.monotonic() - t0


def shared_bomb():
    """~20 KB: one frames list, one block, one segment, one event, each referred to
    thousands of times (memo references): billions of entries for whatever walks it."""
    fr = {"filename": "a.py", "line": 1, "name": "f"}
    frames = [fr] * 2000
    blk = {"size": 512, "requested_size": 512, "address": 0, "state": "active_allocated",
           "frames": frames}
    seg = {"device": 0, "address": 0, "total_size": 1 << 20, "allocated_size": 512,
           "active_size": 512, "requested_size": 512, "stream": 0, "segment_type": "small",
           "blocks": [blk] * 2000}
    ev = {"action": "alloc", "addr": 1, "size": 512, "stream": 0, "time_us": 1,
          "frames": frames}
    return {"segments": [seg] * 500, "device_traces": [[ev] * 3000]}


@pytest.mark.parametrize("protocol", [2, 4])
def test_a_pickle_of_shared_references_is_refused_at_once(tmp_path, protocol):
    p = tmp_path / "shared.pickle"
    p.write_bytes(pickle.dumps(shared_bomb(), protocol=protocol))
    assert p.stat().st_size < 40_000
    line, grown, secs = load_in_child(p)
    assert line.startswith("refused:") and "refers to its own lists" in line, line
    assert secs < 30 and grown < 200_000, (secs, grown)
    # the command: one line, exit 1
    r = gpumon("view", "--summary", str(p), timeout=60)
    assert one_clear_line(r) and "refers to its own lists" in r.stderr, r.stderr[-2000:]


def test_a_gzip_of_zeros_is_refused_at_its_first_byte(tmp_path):
    p = tmp_path / "zeros.pickle.gz"
    with gzip.open(p, "wb") as f:
        for _ in range(16):
            f.write(bytes(16 << 20))  # 256 MiB of zeros, ~250 KB on disk
    line, grown, secs = load_in_child(p)
    assert line.startswith("refused:") and "not a pickle" in line, line
    assert grown < 64 << 10, f"{grown} KiB for a file refused at its first byte"


def test_a_large_random_file_is_refused_without_reading_it_whole(tmp_path):
    p = tmp_path / "random.pickle"
    with open(p, "wb") as f:
        f.write(b"\x00")  # not a pickle opcode
        for _ in range(8):
            f.write(os.urandom(16 << 20))  # 128 MiB
    line, grown, secs = load_in_child(p)
    assert line.startswith("refused:") and "not a pickle" in line, line
    assert grown < 64 << 10, f"{grown} KiB for a file refused at its first byte"


def test_a_gzip_that_unpacks_to_an_endless_stream_stops_at_the_memory_budget(tmp_path):
    """NONE opcodes cost 8 bytes of memory per byte of pickle: 512 MiB of them from ~500 KB
    of gzip would take 4 GiB. The budget (here its floor set to 64 MiB) stops the load."""
    p = tmp_path / "nones.pickle.gz"
    with gzip.open(p, "wb") as f:
        f.write(b"\x80\x02]")
        for _ in range(32):
            f.write(b"N" * (16 << 20))
    line, grown, secs = load_in_child(p, 64 << 20)
    assert line.startswith("refused:") and "of memory" in line, line
    assert grown < 400 << 10, f"{grown} KiB"


def test_a_gzip_bomb_is_refused_by_its_ratio(tmp_path):
    p = tmp_path / "bomb.pickle.gz"
    with gzip.open(p, "wb") as f:  # a valid start, then 400 MiB that compress 1000x
        f.write(b"\x80\x02(")
        for _ in range(25):
            f.write(b"(" * (16 << 20))
    line, grown, secs = load_in_child(p, 4 << 30)
    assert line.startswith("refused:"), line
    assert "times its size" in line or "corrupt" in line or "nests" in line, line
    assert grown < 1 << 20


@pytest.mark.parametrize("name,data,needle", [
    ("nine-bytes", b"\x80\x03B\xff\xff\xff\x7f.", "corrupt"),
    ("frame", b"\x80\x04\x95" + (2 ** 31).to_bytes(8, "little") + b"N.", "corrupt"),
    ("deep-frames", pickle.dumps({"segments": [], "device_traces": [[{
        "action": "alloc", "addr": 1, "size": 8, "stream": 0, "time_us": 1,
        "frames": [{"filename": "a.py", "line": 1, "name": eval("[" * 150 + "]" * 150)}]}]]},
        protocol=2), "nests deeper"),
    ("cycle", b"\x80\x02}q\x00(X\x08\x00\x00\x00segmentsq\x01]q\x02h\x02au.", "contains itself"),
])
def test_small_hostile_files_get_one_line(tmp_path, name, data, needle):
    p = tmp_path / f"{name}.pickle"
    p.write_bytes(data)
    line, grown, secs = load_in_child(p)
    assert line.startswith("refused:") and needle in line, line
    assert grown < 64 << 10, f"{grown} KiB for a {len(data)}-byte file"
    r = gpumon("view", "--summary", str(p), timeout=60)
    assert one_clear_line(r) and needle in r.stderr, r.stderr[-2000:]
