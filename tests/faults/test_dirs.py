"""Issue 22, items 5, 6 and 7: the directories gpumon reads sockets from or writes files into.
The agent and the client refuse a directory that is not yours, that others can write, or that
is a symbolic link, with one line that says what to do, and never change a directory's mode.

"Another user" is simulated: as root, by chown to nobody; otherwise by the cases one user can
make (a symbolic link, a folder others can write)."""
import json
import os
import stat
import time
from pathlib import Path

import pytest

from .harness import Raw, gpumon, gpumon_many, one_clear_line, unharmed

UID = os.getuid()
NOBODY = 65534
CASES = ["symlink", "open"] + (["other-user"] if UID == 0 else [])


def temp_env(tmp_path):
    """No GPUMON_DIR nor XDG_RUNTIME_DIR: gpumon uses <TMPDIR>/gpumon-<uid>, a name anyone can
    take first. TMPDIR is a private stand-in for /tmp (1777)."""
    t = tmp_path / "t"
    t.mkdir()
    t.chmod(0o1777)
    return {"GPUMON_DIR": "", "XDG_RUNTIME_DIR": "", "TMPDIR": str(t)}, t


def plant(victims, tmp_path, how, tmp_path_factory):
    """Someone else's agent, shown where this user's gpumon looks: a live agent's socket file
    moved into <TMPDIR>/gpumon-<uid>, made first by 'the attacker'."""
    env, t = temp_env(tmp_path)
    # a short folder: under xdist tmp_path alone nears the 107 bytes a socket path may have
    theirs = victims("theirs", env={"GPUMON_DIR": str(tmp_path_factory.mktemp("theirs"))})
    target = t / f"gpumon-{UID}"
    if how == "symlink":
        os.symlink(theirs.sock.parent, target)
    else:
        target.mkdir()
        # another user's folder is private (0700), as theirs would be: only the owner check
        # can refuse it (0777 would let the mode check refuse it first, and hide a missing
        # owner check: issue 30 item 6)
        target.chmod(0o777 if how == "open" else 0o700)
        os.rename(theirs.sock, target / theirs.sock.name)
        if how == "other-user":
            os.chown(target, NOBODY, NOBODY)
    return env, target, theirs


@pytest.mark.parametrize("how", CASES)
def test_ls_attach_and_run_refuse_a_socket_dir_they_cannot_trust(victims, tmp_path, how,
                                                                 tmp_path_factory):
    """Item 5: gpumon ls and attach listed the attacker's sockets and showed their figures
    with exit 0; gpumon run died with a PermissionError traceback."""
    env, target, theirs = plant(victims, tmp_path, how, tmp_path_factory)
    argvs = [["ls"], ["ls", "--json"], ["attach", str(theirs.pid), "--once"],
             ["run", "--", "true"], ["snapshot", str(theirs.pid), "--status"]]
    for argv, r in zip(argvs, gpumon_many(argvs, env=env, timeout=90)):
        assert one_clear_line(r), (argv, r.returncode, r.stdout[-500:], r.stderr[-2000:])
        assert str(target) in r.stderr, (argv, r.stderr)
        # ls also reads /tmp and /run/user/UID, which no test owns: a real agent of this user
        # there (another session's) is listed, rightly; the refused folder's never is
        assert (str(theirs.pid) not in r.stdout if argv[0] == "ls" else r.stdout == ""), \
            (argv, r.stdout)
    if how == "open":
        assert stat.S_IMODE(target.stat().st_mode) == 0o777  # refused, not chmod'ed


@pytest.mark.parametrize("how", CASES)
def test_the_agent_does_not_serve_in_a_dir_it_cannot_trust_and_leaves_its_mode(
        victims, tmp_path, how, tmp_path_factory):
    """Item 6: the agent chmod'ed such a directory to 0700 (when it was its own) instead of
    refusing it; the program must run on unharmed, silently."""
    env, target, _ = plant(victims, tmp_path, how, tmp_path_factory)
    mode = os.lstat(target).st_mode
    v = victims("mine", env=env, wait=False)
    # Polled for 3 s, not looked at once: an agent that served 1.2 s late passed that.
    end = time.monotonic() + 3.0
    while time.monotonic() < end:
        assert not list(Path(os.path.realpath(target)).glob(f"{v.pid}.sock"))
        assert os.lstat(target).st_mode == mode
        time.sleep(0.05)
    assert v.alive()
    v.finish()
    ok, why = unharmed(v, tmp_path)
    assert ok, why


@pytest.mark.parametrize("mode", [0o1777, 0o2775, 0o700])
def test_a_shared_gpumon_dir_keeps_its_mode_and_gets_a_private_folder(victims, tmp_path, mode):
    """Item 6: a 1777 GPUMON_DIR lost its sticky bit and world access; a 2775 group directory
    became 0700."""
    base = tmp_path / "shared"
    base.mkdir()
    base.chmod(mode)
    v = victims(env={"GPUMON_DIR": str(base)})
    assert v.sock.parent == base / f"gpumon-{UID}"
    assert v.sock.parent.stat().st_mode & 0o777 == 0o700  # (setgid is inherited from a 2775)
    assert stat.S_IMODE(base.stat().st_mode) == mode
    r = gpumon("ls", "--json", env={"GPUMON_DIR": str(base)})
    assert [row["pid"] for row in json.loads(r.stdout)] == [v.pid]


def attacker_dir(path, how, tmp_path):
    if how == "symlink":
        real = tmp_path / "attackers-own"
        real.mkdir()
        real.chmod(0o777)
        os.symlink(real, path)
        return real
    path.mkdir()
    path.chmod(0o777 if how == "open" else 0o700)  # (see plant: only the owner check refuses)
    if how == "other-user":
        os.chown(path, NOBODY, NOBODY)
    return path


@pytest.mark.parametrize("how", CASES)
def test_the_snapshot_fallback_dir_is_checked(victims, tmp_path, how):
    """Item 7: an attacker-made <tmp>/gpumon-snapshots-<uid> received the victim's pickle and
    sidecar (argv, cwd), readable by them."""
    env, t = temp_env(tmp_path)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    (cwd / "gpumon-snapshots").write_text("a file: the default folder can't be made\n")
    real = attacker_dir(t / f"gpumon-snapshots-{UID}", how, tmp_path)
    v = victims(env={"TMPDIR": str(t)}, cwd=cwd)
    r = Raw(v.sock)
    rep = r.request("snapshot_start", {})
    assert not rep["ok"] and f"gpumon-snapshots-{UID}" in rep["error"], rep
    assert list(real.rglob("*")) == []
    assert r.request("snapshot_status", mid=2)["result"]["recording"] is False
    v.finish()
    ok, why = unharmed(v, tmp_path)
    assert ok, why


def test_out_into_a_dir_others_can_write_is_refused(victims, tmp_path):
    """The same rule for -o / out: a folder others may write (and that has no sticky bit) or
    that is not yours is refused; a sticky one (/tmp) and your own symlinks are fine."""
    v = victims()
    r = Raw(v.sock)
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    rep = r.request("snapshot_start", {"out": str(open_dir) + "/"}, mid=1)
    assert not rep["ok"] and "writable by others" in rep["error"] and str(open_dir) in rep["error"]
    rep = r.request("snapshot_start", {"out": str(open_dir / "x.pickle")}, mid=2)
    assert not rep["ok"] and "writable by others" in rep["error"]
    sticky = tmp_path / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)
    mine = tmp_path / "mine"
    mine.mkdir()
    os.symlink(mine, tmp_path / "link")
    for i, out in enumerate([sticky / "a.pickle", tmp_path / "link" / "b.pickle"]):
        rep = r.request("snapshot_start", {"out": str(out)}, mid=10 + i)
        assert rep["ok"], rep
        rep = r.request("snapshot_stop", {}, mid=20 + i)
        assert rep["ok"] and os.path.exists(out), rep
    assert list(open_dir.iterdir()) == []
    v.finish()
    ok, why = unharmed(v, tmp_path)
    assert ok, why


def test_gpumon_log_in_a_dir_others_can_write_is_not_used(victims, tmp_path, gpumon_dir):
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    v = victims(env={"GPUMON_LOG": str(open_dir / "agent.log")})
    v.finish()
    assert not (open_dir / "agent.log").exists()
    assert "GPUMON_LOG not used" in (gpumon_dir / "agent.log").read_text()
    ok, why = unharmed(v, tmp_path)
    assert ok, why


def test_a_socket_folder_too_long_for_a_socket_path_is_one_line(victims, tmp_path):
    """A GPUMON_DIR whose socket path would not fit sun_path (107 bytes): the agent bound its
    temporary name, failed (AF_UNIX path too long) and never served, while ls said nothing."""
    deep = tmp_path / ("d" * max(1, 100 - len(str(tmp_path))))
    deep.mkdir()
    env = {"GPUMON_DIR": str(deep)}
    v = victims("long", env=env, wait=False)
    end = time.monotonic() + 3.0  # polled: a late agent must be caught too
    while time.monotonic() < end:
        assert v.alive() and not list(deep.rglob("*.sock"))
        time.sleep(0.05)
    for argv in (["ls"], ["attach", str(v.pid), "--once"]):
        r = gpumon(*argv, env=env)
        assert one_clear_line(r) and "too long" in r.stderr and "GPUMON_DIR" in r.stderr, (argv, r)
    v.finish()
    ok, why = unharmed(v, tmp_path)
    assert ok, why
