"""Where gpumon writes files, and which directories it trusts. Standard library only: the agent
imports it inside the training process, and the client calls the same functions, so both sides
refuse the same directories with the same line.

Two kinds of directory:

- **gpumon's own, found by name** (anyone can guess the name and make it first): the socket
  directory ``<base>/gpumon-<uid>`` (base: ``$GPUMON_DIR``, else ``$XDG_RUNTIME_DIR``, else the
  temp dir) and the snapshot fallback ``<tmp>/gpumon-snapshots-<uid>``. gpumon creates it with
  mode 0700. One that exists must be a real directory (not a symbolic link), owned by you, and
  writable by nobody else; its parent must not be writable by everyone unless it has the sticky
  bit (as /tmp has). gpumon never changes the mode of a directory: it refuses, with one line
  that says what to do. A shared ``$GPUMON_DIR`` (1777, or a 2775 group directory) keeps its
  mode; each user gets a private ``gpumon-<uid>`` inside it.
- **a place the user names** (``-o``/``out``, the folder of ``$GPUMON_LOG``) and the program's
  default snapshot folder ``<cwd>/gpumon-snapshots/...``: symbolic links are followed (yours may
  point to a bigger disk); the directory must be owned by you or root and writable by nobody
  else unless it has the sticky bit, and its parent must not be writable by everyone unless
  sticky.

A refusal is an ``UnsafeDirectory`` (a PermissionError) whose text is the one line for the user.
"""
from __future__ import annotations

import errno
import os
import stat
import tempfile
from typing import Any, Callable

SOCKET_HINT = "or set GPUMON_DIR to a directory of yours (gpumon makes a private folder in it)"


class UnsafeDirectory(PermissionError):
    """A directory gpumon will not use; str() is one line that says why and what to do."""


def _owner(uid: int) -> str:
    try:
        import pwd
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except Exception:
        return f"uid {uid}"


def _mode(st: os.stat_result) -> str:
    return f"mode {stat.S_IMODE(st.st_mode):04o}"


def _check_parent(path: str) -> None:
    """A parent that everyone may write without the sticky bit lets anyone swap our folder."""
    parent = os.path.dirname(os.path.abspath(path)) or "/"
    try:
        st = os.stat(parent)
    except OSError:
        return  # creating below will fail with its own error
    if st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
        raise UnsafeDirectory(
            f"{parent} is writable by everyone without the sticky bit ({_mode(st)}), so anyone "
            f"could replace gpumon's folder in it: chmod +t {parent}, or use another place")


def base_dir() -> str:
    """Where the socket directory is made: ``$GPUMON_DIR``, else ``$XDG_RUNTIME_DIR``, else the
    temp dir."""
    d = os.environ.get("GPUMON_DIR")
    if d:
        return os.path.abspath(os.path.expanduser(d))
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isabs(xdg) and os.path.isdir(xdg):
        return xdg
    return tempfile.gettempdir()


def own_dir_name(prefix: str = "gpumon") -> str:
    return f"{prefix}-{os.getuid()}"


def private_dir(path: str, create: bool, hint: str) -> str:
    """Check (and with create, make) one of gpumon's own directories. Raises UnsafeDirectory
    (one line ending with ``hint``, what to do) or OSError from mkdir. Without create, a
    directory that does not exist is returned unchecked (there is nothing in it to trust)."""
    _check_parent(path)
    if create:
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        if create:
            raise
        return path
    uid = os.getuid()
    if stat.S_ISLNK(st.st_mode):
        raise UnsafeDirectory(f"{path} is a symbolic link, not a folder gpumon made: remove it "
                              f"(rm {path}) {hint}")
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeDirectory(f"{path} is not a directory: remove it {hint}")
    if st.st_uid != uid:
        raise UnsafeDirectory(f"{path} belongs to {_owner(st.st_uid)}, not to you: ask its owner "
                              f"or an admin to remove it, {hint}")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UnsafeDirectory(f"{path} is writable by others ({_mode(st)}): chmod 700 {path}, "
                              f"{hint}")
    return path


# A unix socket's path must fit sun_path (108 bytes with the NUL on Linux); the longest name
# gpumon binds is "<pid>.sock" with a 7-digit pid, so its folder may be this long at most.
SOCKET_DIR_MAX = 107 - len("/4194304.sock")


def socket_dir(create: bool = False) -> str:
    """The socket directory ``<base>/gpumon-<uid>``, checked (see the module doc)."""
    base = base_dir()
    path = os.path.join(base, own_dir_name())
    if len(os.fsencode(path)) > SOCKET_DIR_MAX:
        raise UnsafeDirectory(
            f"{path} is too long for a socket path ({len(os.fsencode(path))} bytes, at most "
            f"{SOCKET_DIR_MAX}): set GPUMON_DIR to a shorter directory of yours")
    if create and not os.path.isdir(base):
        os.makedirs(base, 0o700, exist_ok=True)  # a GPUMON_DIR that does not exist yet
    return private_dir(path, create, SOCKET_HINT)


def check_dest_dir(path: str, hint: str = "pass a directory of yours") -> None:
    """A directory a file will be written into, named by the user or the default snapshot
    folder (see the module doc). Raises UnsafeDirectory; a directory that does not exist is
    left to the write to report."""
    real = os.path.realpath(path)
    try:
        st = os.stat(real)
    except OSError:
        return
    shown = path if real == os.path.abspath(path) else f"{path} (-> {real})"
    if st.st_uid not in (os.getuid(), 0):
        raise UnsafeDirectory(f"{shown} belongs to {_owner(st.st_uid)}, not to you: {hint}")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
        raise UnsafeDirectory(f"{shown} is writable by others ({_mode(st)}): {hint}")
    _check_parent(real)


def make_dest_dir(path: str, hint: str = "pass a directory of yours") -> None:
    """Create ``path`` (and missing parents, the last one with mode 0700) after checking the
    deepest folder that exists, then check ``path`` as ``check_dest_dir`` does. Raises
    UnsafeDirectory or OSError."""
    path = os.path.abspath(path)
    existing = path
    while not os.path.exists(existing) and os.path.dirname(existing) != existing:
        existing = os.path.dirname(existing)
    if existing != path:
        check_dest_dir(existing, hint)  # nothing is created inside someone else's folder
        os.makedirs(path, 0o700, exist_ok=True)
    check_dest_dir(path, hint)


# -- writing through a checked directory descriptor ---------------------------------------------
# Every file gpumon writes goes through a descriptor of its directory, opened without following
# a symbolic link in its last component and checked as opened (fstat): a link planted or flipped
# after the check changes nothing, since the name is never looked up again from the top.
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC


def open_dir(path: str, private: bool = False, hint: str = "pass a directory of yours") -> int:
    """A descriptor of the directory ``path``, checked: for one of gpumon's own (private), a
    real directory of yours that nobody else may write; for a place the user names, owned by
    you or root and not writable by others unless sticky. The last component may be a symbolic
    link only for a place the user names, and only a link of yours (or root's): one planted by
    someone else in a shared folder is refused. Raises UnsafeDirectory or OSError; the caller
    closes the descriptor."""
    try:
        fd = os.open(path, _DIR_FLAGS | os.O_NOFOLLOW)
    except OSError as e:
        if e.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise
        st = os.lstat(path)  # Linux says ENOTDIR (O_DIRECTORY) or ELOOP for a link
        if not stat.S_ISLNK(st.st_mode):
            raise UnsafeDirectory(f"{path} is not a directory: {hint}") from None
        if private or st.st_uid not in (os.getuid(), 0):
            who = "" if private else f" of {_owner(st.st_uid)}"
            raise UnsafeDirectory(f"{path} is a symbolic link{who}, not a folder gpumon may "
                                  f"write into: remove it (rm {path}) or {hint}") from None
        fd = os.open(path, _DIR_FLAGS)  # a link of yours: followed, and its target checked
    try:
        st = os.fstat(fd)
        owners = (os.getuid(),) if private else (os.getuid(), 0)
        if st.st_uid not in owners:
            raise UnsafeDirectory(f"{path} belongs to {_owner(st.st_uid)}, not to you: {hint}")
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and (private or not st.st_mode & stat.S_ISVTX):
            raise UnsafeDirectory(f"{path} is writable by others ({_mode(st)}): {hint}")
    except BaseException:
        os.close(fd)
        raise
    return fd


def write_at(dir_fd: int, name: str, write: Callable[[Any], None], mode: int = 0o600) -> int:
    """Write the file ``name`` inside the directory ``dir_fd`` atomically: a hidden temporary
    file created there (O_EXCL, O_NOFOLLOW), ``write(f)``, fsync, fchmod to ``mode``, then a
    rename relative to the same descriptor. Returns its size. On any failure (ENOSPC...) the
    temporary file is removed and the error raised; the old file, if any, is untouched."""
    import secrets
    tmp = f".{name}.{secrets.token_hex(4)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600, dir_fd=dir_fd)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fchmod(f.fileno(), mode)
            os.fsync(f.fileno())
            size = f.tell()
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        try:
            os.unlink(tmp, dir_fd=dir_fd)
        except OSError:
            pass
        raise
    try:  # make the rename durable too
        os.fsync(dir_fd)
    except OSError:
        pass
    return size


def write_file(path: str, write: Callable[[Any], None], mode: int = 0o600,
               private: bool = False, hint: str = "pass a directory of yours") -> int:
    """``write_at`` into the directory of ``path``, opened and checked by ``open_dir``."""
    d = os.path.dirname(os.path.abspath(path))
    dfd = open_dir(d, private=private, hint=hint)
    try:
        return write_at(dfd, os.path.basename(path), write, mode)
    finally:
        os.close(dfd)
