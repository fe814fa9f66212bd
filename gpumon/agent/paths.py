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


def too_long_for_sockets(path: str) -> str | None:
    """Why no agent can serve in the socket folder ``path`` (its sockets' paths would not fit
    sun_path), or None."""
    n = len(os.fsencode(path))
    if n <= SOCKET_DIR_MAX:
        return None
    return (f"{path} is too long for a socket path ({n} bytes, at most {SOCKET_DIR_MAX}): set "
            "GPUMON_DIR to a shorter directory of yours")


def socket_dir(create: bool = False) -> str:
    """The socket directory ``<base>/gpumon-<uid>``, checked (see the module doc)."""
    base = base_dir()
    path = os.path.join(base, own_dir_name())
    why = too_long_for_sockets(path)
    if why:
        raise UnsafeDirectory(why)
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
    """Create ``path`` (and missing parents, with mode 0700) inside the deepest folder that
    exists, opened and checked as ``open_dir`` does (a planted link on the way is refused
    before anything is made in the folder it points to), each new folder made and entered
    relative to the one above it; then check ``path`` as ``check_dest_dir`` does. Raises
    UnsafeDirectory or OSError."""
    path = os.path.abspath(path)
    existing, missing = path, []
    while not os.path.lexists(existing) and os.path.dirname(existing) != existing:
        missing.insert(0, os.path.basename(existing))
        existing = os.path.dirname(existing)
    fd = open_dir(existing, hint=hint)  # nothing is created inside someone else's folder
    try:
        for name in missing:
            try:
                os.mkdir(name, 0o700, dir_fd=fd)
            except FileExistsError:
                pass
            nfd = os.open(name, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=fd)
            os.close(fd)
            fd = nfd
    finally:
        os.close(fd)
    os.close(open_dir(path, hint=hint))
    check_dest_dir(path, hint)


# -- writing through a checked directory descriptor ---------------------------------------------
# Every file gpumon writes goes through a descriptor of its directory, opened without following
# a symbolic link in its last component and checked as opened (fstat): a link planted or flipped
# after the check changes nothing, since the name is never looked up again from the top.
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC


MAX_LINKS = 40  # as the kernel's own limit on links followed in one lookup


def _walk(path: str, private: bool, hint: str) -> int:
    """Open the directory ``path`` from ``/``, one component at a time with O_NOFOLLOW, so no
    name is looked up twice and every symbolic link on the way is judged before it is
    followed: one that someone else could have planted (owned by another user, in a folder
    others may write, like a sticky /tmp or a shared cwd) is refused; for one of gpumon's own
    folders (private) the last component may not be a link at all."""
    fd = os.open("/", _DIR_FLAGS)
    parts = [p for p in os.path.abspath(path).split("/") if p]
    links = 0
    try:
        while parts:
            name = parts.pop(0)
            try:
                nfd = os.open(name, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=fd)
            except OSError as e:
                if e.errno not in (errno.ELOOP, errno.ENOTDIR):
                    raise
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                if not stat.S_ISLNK(st.st_mode):
                    raise UnsafeDirectory(f"{path} is not a directory: {hint}") from None
                holder = os.fstat(fd)
                planted = (st.st_uid not in (os.getuid(), 0)
                           and holder.st_mode & (stat.S_IWGRP | stat.S_IWOTH))
                if planted or (private and not parts):
                    who = f" of {_owner(st.st_uid)}" if st.st_uid != os.getuid() else ""
                    raise UnsafeDirectory(
                        f"{path} is (or goes through) a symbolic link{who}, not a folder gpumon "
                        f"may write into: remove it or {hint}") from None
                links += 1
                if links > MAX_LINKS:
                    raise OSError(errno.ELOOP, "Too many levels of symbolic links", path)
                target = os.readlink(name, dir_fd=fd)
                if target.startswith("/"):
                    os.close(fd)
                    fd = -1
                    fd = os.open("/", _DIR_FLAGS)
                parts = [p for p in target.split("/") if p and p != "."] + parts
                continue
            os.close(fd)
            fd = nfd
        return fd
    except BaseException:
        if fd >= 0:
            os.close(fd)
        raise


def open_dir(path: str, private: bool = False, hint: str = "pass a directory of yours") -> int:
    """A descriptor of the directory ``path``, checked as opened: for one of gpumon's own
    (private), a real directory of yours that nobody else may write; for a place the user
    names, owned by you or root and not writable by others unless sticky. Symbolic links on
    the way are followed only where nobody else could have planted them (``_walk``). Raises
    UnsafeDirectory or OSError; the caller closes the descriptor."""
    fd = _walk(path, private, hint)
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


def create_new(path: str, private: bool = True, hint: str = SOCKET_HINT) -> int:
    """A new file's descriptor (write-only, mode 0600; it must not exist, and a link in its
    place is not followed), made through a checked descriptor of its folder. The caller
    closes it."""
    dfd = open_dir(os.path.dirname(os.path.abspath(path)), private=private, hint=hint)
    try:
        return os.open(os.path.basename(path), os.O_WRONLY | os.O_CREAT | os.O_EXCL
                       | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dfd)
    finally:
        os.close(dfd)


def write_private(path: str, data: bytes) -> None:
    """``data`` as the file ``path`` in one of gpumon's own folders (mode 0600, atomically)."""
    write_file(path, lambda f: f.write(data), private=True, hint=SOCKET_HINT)
