"""Writes never follow a planted link (issue 30 item 4): the default snapshot folder
``<cwd>/gpumon-snapshots`` in a shared (sticky, world-writable) cwd, made a symbolic link by
another user, received root's pickle and sidecar (argv, cwd); a link flipping between a folder
the check accepts and one another user chose won the race 1 time in 12. Every write now goes
through a directory descriptor opened component by component (paths.open_dir)."""
from __future__ import annotations

import errno
import os
import threading

import pytest

from gpumon.agent import paths
from gpumon.agent import snapshot as snap
from tests.capture.fakes import Events, FakeMemoryAPI

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")
NOBODY = 65534


def shared_cwd(tmp_path):
    cwd = tmp_path / "shared"
    cwd.mkdir()
    cwd.chmod(0o1777)  # /tmp-like: anyone may create names in it
    return cwd


def planted_link(cwd, to):
    link = cwd / "gpumon-snapshots"
    os.symlink(to, link)
    os.lchown(link, NOBODY, NOBODY)  # made by the other user
    return link


def recorder(cwd, tmp_path, monkeypatch):
    fb = tmp_path / "tmpdir"
    fb.mkdir(exist_ok=True)
    monkeypatch.setattr(snap.tempfile, "gettempdir", lambda: str(fb))
    return snap.Recorder(None, backend=FakeMemoryAPI(), broadcast=Events(), pid=4242,
                         cwd=str(cwd), start_time=1_700_000_000.0, rank=None), fb


def all_files(d):
    return sorted(str(p) for p in d.rglob("*") if p.is_file())


@needs_root
def test_a_planted_snapshot_folder_is_refused_with_one_line(tmp_path, monkeypatch):
    """The link points to a folder of root's that passes the owner check: before, the pickle
    and its sidecar went there."""
    cwd = shared_cwd(tmp_path)
    chosen = tmp_path / "chosen-by-them"
    chosen.mkdir(mode=0o755)
    planted_link(cwd, chosen)
    rec, fb = recorder(cwd, tmp_path, monkeypatch)
    rec.start({}, "c")
    rec.backend.alloc(1 << 20)
    facts = rec.stop({}, "c")
    assert all_files(chosen) == []
    # Written instead to gpumon's private fallback, and the note says why in one line.
    assert facts["path"].startswith(str(fb)) and os.path.exists(facts["path"])
    assert "symbolic link" in facts["note"] and "\n" not in facts["note"]


@needs_root
def test_a_flipping_link_never_wins(tmp_path, monkeypatch):
    cwd = shared_cwd(tmp_path)
    good, theirs = tmp_path / "root-owned", tmp_path / "theirs"
    good.mkdir(mode=0o755)
    theirs.mkdir(mode=0o755)
    link = planted_link(cwd, good)
    stop = threading.Event()

    def flip():  # as the other user would: replace the link, atomically, as fast as it can
        tmp = cwd / ".flip"
        while not stop.is_set():
            for to in (theirs, good):
                try:
                    os.symlink(to, tmp)
                    os.lchown(tmp, NOBODY, NOBODY)
                    os.replace(tmp, link)
                except OSError:
                    pass
    t = threading.Thread(target=flip, daemon=True)
    t.start()
    try:
        rec, _ = recorder(cwd, tmp_path, monkeypatch)
        for i in range(24):
            if rec.session is None:
                rec.start({}, "c")
            rec.backend.alloc(4096)
            try:
                rec.stop({}, "c")
            except snap.SnapshotError:
                pass
    finally:
        stop.set()
        t.join()
    assert all_files(theirs) == [] and all_files(good) == []


def test_own_links_are_followed_and_a_link_as_the_last_private_component_is_not(tmp_path):
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    os.symlink(real, tmp_path / "mine")
    paths.write_file(str(tmp_path / "mine" / "a.txt"), lambda f: f.write(b"x"))
    assert (real / "a.txt").read_bytes() == b"x"
    with pytest.raises(paths.UnsafeDirectory, match="symbolic link"):
        paths.write_file(str(tmp_path / "mine" / "b.txt"), lambda f: f.write(b"x"), private=True)


def test_a_link_planted_as_the_file_itself_is_replaced_not_followed(tmp_path):
    d = tmp_path / "d"
    d.mkdir(mode=0o700)
    victim = tmp_path / "their-file"
    victim.write_text("theirs\n")
    os.symlink(victim, d / "out.pickle")
    paths.write_file(str(d / "out.pickle"), lambda f: f.write(b"ours"))
    assert victim.read_text() == "theirs\n" and (d / "out.pickle").read_bytes() == b"ours"
    assert not (d / "out.pickle").is_symlink()


def test_disk_full_leaves_nothing_and_is_one_line(tmp_path):
    d = tmp_path / "d"
    d.mkdir(mode=0o700)

    def full(f):
        f.write(b"x" * 1000)
        raise OSError(errno.ENOSPC, "No space left on device")
    with pytest.raises(OSError) as e:
        paths.write_file(str(d / "s.pickle"), full)
    assert e.value.errno == errno.ENOSPC and os.listdir(d) == []
    from gpumon.agent.snapshot_files import _os_error_line
    line = _os_error_line(e.value, str(d / "s.pickle"))
    assert line.startswith("disk full while writing") and "\n" not in line


def test_the_written_file_has_the_mode_asked_for_whatever_the_umask(tmp_path):
    d = tmp_path / "d"
    d.mkdir(mode=0o700)
    old = os.umask(0o077)
    try:
        paths.write_file(str(d / "t.prom"), lambda f: f.write(b"x"), mode=0o644)
    finally:
        os.umask(old)
    assert (d / "t.prom").stat().st_mode & 0o777 == 0o644
