"""Memory-snapshot capture and the OOM flight recorder, inside the training process.

Standard library only; torch is taken from ``sys.modules`` (never imported here), so this module
can run wherever the agent runs, injected included.

Commands (registered with ``core.register_command`` by ``install(agent)``)
-------------------------------------------------------------------------
``snapshot_start`` args (all optional)::

    {"stacks": "python" | "all",   # "python" (default) dumps fast; "all" adds C++ frames
     "max_entries": int,           # ring size of the allocation history (default 100000)
     "seconds": float | null,      # stop and dump by itself after this long
     "steps": int | null,          # ... or after this many optimizer steps
     "out": path | null,           # file (or existing directory) to write; default below
     "who": str | null,            # a label for other clients ("gpumon attach", ...)
     "keep": bool}                 # keep recording when this client's connection ends
                                   # (gpumon snapshot --start); else the recording belongs to
                                   # the connection: when it ends (the client quit, was
                                   # killed, its ssh dropped) the agent stops and dumps it,
                                   # reason "client gone", and says where in the events below

  result: ``{"recording": true, "since": t, "by": client_id, "stacks", "max_entries",
  "seconds", "steps", "user_recording": bool, "note": str | null}``. Error while another client
  records: "already recording: started by <who> at HH:MM:SS (N s ago) ...".
``snapshot_stop`` args ``{"out": path | null}``: dumps, stops recording (unless the program or
  the OOM recorder had it on), result = the snapshot facts below. If the dump fails (disk full,
  no permission) the error says so and the recording stays on, so a retry with another ``out``
  loses nothing.
``snapshot_status``: ``{"recording": bool, "by", "since", "elapsed", "seconds", "steps",
  "steps_done", "dumping": bool, "oom_recorder": bool, "available": bool, "reason": str | null,
  "last": snapshot facts | null}``.

Snapshot facts (reply of ``snapshot_stop``, payload of the ``snapshot`` event)::

    {"ok": true, "path": str, "size": bytes, "entries": trace entries, "trigger": "manual" |
     "oom" | "exit", "simulated": bool, "sidecar": str | null, "since": t, "until": t,
     "reason": "stop" | "seconds" | "steps" | "exit", "steps": int | null, "note": str | null}

  (a failed dump gives an event ``{"kind": "snapshot", "ok": false, "path": null, "error": str,
  "trigger": ...}``).

Events (``core.broadcast_event``)::

    recording  {"state": "started", "by", "who", "since", "stacks", "max_entries", "seconds",
                "steps", "keep"}
               {"state": "stopped", "by", "who", "since", "until", "reason":
                "stop" | "seconds" | "steps" | "exit" | "client gone", "path": str | null}
    snapshot   snapshot facts as above
    oom        {"device", "requested", "device_total", "free", "allocated", "reserved",
                "time", "path": str | null, "error": str | null}

Files
-----
Default place: ``<cwd of the process>/gpumon-snapshots/<pid>-<YYYYmmdd-HHMMSS of agent
start>/``, names ``[rank<R>-]{snapshot,oom,exit}-<n>-<HHMMSS>.pickle`` (``simulated-`` in front
for the simulated source). If that folder can't be written, the temp dir is used instead
(``<tmp>/gpumon-snapshots-<uid>/...``) and the reply says so. An explicit ``out`` is never
replaced by another place: it fails clearly instead.

The ``.pickle`` is exactly what ``torch.cuda.memory._dump_snapshot`` writes (``pickle.dump`` of
``torch.cuda.memory._snapshot()``), so pytorch.org/memory_viz loads it unchanged. It is written
atomically: to a hidden temp name in the same folder, fsync'd, then ``os.replace``'d, so a file
under the final name is always complete.

Beside it, ``<file>.pickle.json`` (the sidecar, written after the pickle, also atomically)::

    {"format": "gpumon-snapshot-meta", "version": 1,
     "kind": "manual" | "oom" | "exit", "simulated": bool,
     "pid": int, "argv": [...], "cwd": str, "hostname": str, "rank": int | null,
     "torch": str | null, "python": str,
     "since": unix s (recording start; null for an OOM dump of the flight recorder),
     "until": unix s (dump time), "by": client id | null, "who": str | null,
     "stacks": "python" | "all" | null, "max_entries": int | null,
     "user_recording": bool (history was already on, started by the program),
     "entries": int, "size": int (bytes of the pickle), "steps": int | null (steps counted),
     "oom": null | {"device": int, "requested": bytes, "device_total": bytes,
                    "device_free": bytes, "allocated": bytes | null, "reserved": bytes | null,
                    "time": unix s},
     "timeline": null | {"clock": "time_us", "steps": [{"step": int, "start_us": int,
                    "end_us": int | null, "phases": [{"phase": str, "start_us": int,
                    "end_us": int | null}]}]},
     "grads": null | {"clock": "time_us", "names": [str], "owners": [str], "owner_of": [int],
                  "steps": [{"time_us": int, "device": int, "ptr": [int], "size": [int],
                             "name": [int]}]}}

``grads``: the ``.grad`` of every parameter each optimizer step read while the recording was
on (gpumon/agent/grads.py): address, size and the parameter's name, taken on the training
thread at a global optimizer-step pre-hook; `gpumon view` names those allocations by them.

``timeline``: the training steps and phases that overlap the recording, as the phases tracker
saw them (gpumon/agent/phases/timeline.py), in the clock and unit of the trace entries'
``time_us`` (unix microseconds); null when the tracker saw none. A recording started in the
middle of a run holds no ``Optimizer.step`` annotations from torch: this is where its steps are.

``oom.allocated`` / ``oom.reserved`` are ``torch.cuda.memory_allocated/reserved(device)`` read
inside the observer, i.e. at the moment of the OOM, before the exception propagates.

OOM flight recorder
-------------------
Enabled by ``gpumon.start(oom_snapshot=True)`` (the agent's ``oom_snapshot`` attribute), the
environment variable ``GPUMON_OOM_SNAPSHOT=1`` (what ``gpumon run --oom-snapshot`` sets), or
``enable_oom_snapshot()``. As soon as CUDA is initialised (``torch.cuda._lazy_call``: before
the program's first CUDA allocation when the agent started first) it turns on a bounded history
(python stacks, ``GPUMON_OOM_MAX_ENTRIES``, default 100000) and relies on the out-of-memory
observer, which is attached once per process and cannot be detached: it does nothing unless the
recorder is on and never raises. At an OOM it dumps a snapshot (whose trace ends with the
``oom`` entry) before the exception propagates; the program's exception and exit status are
unchanged. At most ``GPUMON_OOM_MAX_DUMPS`` (default 3) dumps per process, so a program that
probes batch sizes by catching OOMs is not slowed by many dumps.
"""
from __future__ import annotations

import atexit
import json
import os
import pickle
import platform
import socket
import sys
import tempfile
import threading
import time
from functools import partial

from gpumon.agent import history, paths
from gpumon.agent.snapshot_backends import (DEFAULT_MAX_ENTRIES, SimulatedBackend,
                                            TorchBackend)
from gpumon.agent.snapshot_files import _check_writable_dir, _os_error_line, write_atomic

# What a client may ask for: the history lives in the program's host memory, a timer in its
# process. (The program's own GPUMON_OOM_MAX_ENTRIES is not capped.)
MAX_ENTRIES_CAP = 1_000_000
MAX_SECONDS = 7 * 24 * 3600.0
SIDECAR_FORMAT = "gpumon-snapshot-meta"
SIDECAR_SUFFIX = ".json"


class SnapshotError(Exception):
    """One clear line for the user; raised where a command must fail."""


def _log(msg: str) -> None:
    try:
        from gpumon.agent.log import get_logger  # core's log: never the program's stderr
        get_logger().info("snapshot: %s", msg)
    except Exception:
        pass


# --------------------------------------------------------------------------------------------
# The recorder
# --------------------------------------------------------------------------------------------

class _Session:
    def __init__(self, by, who, since, stacks, max_entries, seconds, steps, out, ours,
                 user_recording, owner=None):
        self.by, self.who, self.since = by, who, since
        self.owner = owner  # the connection it belongs to (None: kept after its client goes)
        self.stacks, self.max_entries = stacks, max_entries
        self.seconds, self.steps, self.out = seconds, steps, out
        self.ours = ours                      # we turned torch's history on for this session
        self.user_recording = user_recording  # it was already on, started by the program
        self.steps_done = 0
        # took over the phases meter's trace-only history: its entries (no stack) from before
        # this time (unix us, read once the recording was restarted) are left out of the file;
        # an entry with a stack is this recording's even if the clock puts it a little earlier
        self.trace_from_us: int | None = None
        self.first_optimizer = None
        self.timer: threading.Timer | None = None
        self.hook = None
        self.grads = None       # GradLog: the .grads the optimizer stepped (sidecar "grads")
        self.grad_hook = None


class Recorder:
    def __init__(self, agent=None, backend=None, *, broadcast=None, pid=None, cwd=None,
                 start_time=None, rank=None):
        self.agent = agent
        self.backend = backend if backend is not None else _choose_backend(agent)
        self._broadcast = broadcast
        self.pid = pid or os.getpid()
        self.cwd = cwd or os.getcwd()
        self.start_time = start_time or getattr(agent, "started_at", None) or time.time()
        if rank is None:
            from gpumon.agent.jobenv import ranks_of
            rank = ranks_of(os.environ)[0]
        self.rank = rank
        self.lock = threading.RLock()
        self.session: _Session | None = None
        self.dumping = False
        self.count = 0
        self.last: dict | None = None
        self.fallback_note: str | None = None
        # OOM flight recorder
        self.oom_enabled = False
        self.oom_max_entries = _env_int("GPUMON_OOM_MAX_ENTRIES", DEFAULT_MAX_ENTRIES)
        self.oom_max_dumps = _env_int("GPUMON_OOM_MAX_DUMPS", 3)
        self.oom_dumps = 0
        self.flight_ours = False      # we turned history on for the flight recorder
        self.observer_attached = False
        self._in_oom = False
        self._cuda_hooked = False
        self._closed = False

    # ---- helpers --------------------------------------------------------------------------
    def broadcast(self, event: str, /, **payload) -> None:
        try:
            if self._broadcast is not None:
                self._broadcast(event, **payload)
            else:
                from gpumon.agent import core
                core.broadcast_event(event, **payload)
        except Exception as e:  # a client problem never reaches the program
            _log(f"broadcast {event} failed: {e!r}")

    def run_dir(self) -> str:
        stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(self.start_time))
        return os.path.join(self.cwd, "gpumon-snapshots", f"{self.pid}-{stamp}")

    def _fallback_base(self) -> str:
        return os.path.join(tempfile.gettempdir(), paths.own_dir_name("gpumon-snapshots"))

    def _fallback_dir(self) -> str:
        stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(self.start_time))
        return os.path.join(self._fallback_base(), f"{self.pid}-{stamp}")

    def _file_name(self, kind: str) -> str:
        self.count += 1
        prefix = "simulated-" if self.backend.simulated else ""
        if self.rank is not None:
            prefix += f"rank{self.rank}-"
        name = "snapshot" if kind == "manual" else kind
        return f"{prefix}{name}-{self.count}-{time.strftime('%H%M%S')}.pickle"

    def _resolve_out(self, out) -> str | None:
        if out is None or out == "":
            return None
        if not isinstance(out, str) or "\0" in out:
            raise SnapshotError(f"out must be a path (a string), not {type(out).__name__} "
                                f"{str(out)[:40]}")
        out = os.path.expanduser(out)
        if not os.path.isabs(out):
            out = os.path.join(self.cwd, out)
        return out

    def _target(self, kind: str, out: str | None) -> tuple[str, str | None]:
        """(path to write, note). Explicit out: that file, or a new name inside that folder."""
        note = None
        if out:
            if os.path.isdir(out) or out.endswith(os.sep):
                _check_writable_dir(out)
                return os.path.join(out, self._file_name(kind)), None
            parent = os.path.dirname(out) or "."
            _check_writable_dir(parent)
            return out, None
        d = self.run_dir()
        try:
            _check_writable_dir(d)
        except OSError as e:
            fb = self._fallback_dir()
            try:
                _check_writable_dir(fb, self._fallback_base())
            except OSError:
                raise e from None
            note = f"{_os_error_line(e, d)}; wrote to {fb} instead"
            d = fb
        return os.path.join(d, self._file_name(kind)), note

    def _meta(self, kind, snap_entries, size, session: _Session | None, oom=None) -> dict:
        return {
            "format": SIDECAR_FORMAT, "version": 1, "kind": kind,
            "simulated": bool(self.backend.simulated),
            "pid": self.pid, "argv": list(getattr(sys, "argv", [])), "cwd": self.cwd,
            "hostname": socket.gethostname(), "rank": self.rank,
            "torch": self.backend.version(), "python": platform.python_version(),
            "since": session.since if session else None, "until": time.time(),
            "by": session.by if session else None, "who": session.who if session else None,
            "stacks": session.stacks if session else ("python" if kind == "oom" else None),
            "max_entries": session.max_entries if session else (
                self.oom_max_entries if kind == "oom" else None),
            "user_recording": bool(session.user_recording) if session else False,
            "entries": snap_entries, "size": size,
            "steps": session.steps_done if session and session.steps else None,
            "oom": oom,
            "agent": _agent_version(),
        }

    def _timeline(self, snap: dict) -> dict | None:
        """The steps and phases over the trace's time range (the sidecar's ``timeline``)."""
        try:
            ts = [e.get("time_us") for tr in snap.get("device_traces", []) or []
                  for e in (tr[:1] + tr[-1:]) if isinstance(e, dict)]
            ts = [t for t in ts if isinstance(t, int)]
            fn = getattr(self.backend, "timeline", None)
            if fn is None:
                return None
            return fn(min(ts) if ts else None, max(ts) if ts else None)
        except Exception as e:  # a sidecar without a timeline, never a failed dump
            _log(f"timeline: {e!r}")
            return None

    def _module_annotations(self, snap: dict) -> dict | None:
        """Module enter/leave logged while this recording ran (gpumon/agent/modules.py): the
        sidecar's ``modules``; the logging stops here."""
        mod = sys.modules.get("gpumon.agent.modules")
        if mod is None:
            return None
        ts = [e.get("time_us") for tr in snap.get("device_traces", []) or []
              for e in (tr[:1] + tr[-1:]) if isinstance(e, dict)]
        ts = [t for t in ts if isinstance(t, int)]
        return mod.annotate_stop(min(ts) if ts else None, max(ts) if ts else None)

    def dump(self, kind: str, out=None, session: _Session | None = None, oom=None) -> dict:
        """Take the snapshot and write it (+ sidecar). Raises SnapshotError. Thread: any."""
        if getattr(self.backend, "simulated", False) and session is not None and session.steps:
            snap = self.backend.snapshot(steps=session.steps_done)  # the steps asked for
        else:
            snap = self.backend.snapshot()
        cut = session.trace_from_us if session is not None else None
        if cut is not None:
            snap["device_traces"] = [
                [e for e in tr if not isinstance(e, dict) or "frames" in e
                 or e.get("time_us", cut) >= cut]
                for tr in snap.get("device_traces", []) or []]
        entries = sum(len(t) for t in snap.get("device_traces", []) or [])
        timeline = self._timeline(snap)
        modules = self._module_annotations(snap) if session is not None else None
        try:
            path, note = self._target(kind, self._resolve_out(out))
        except OSError as e:
            where = self._resolve_out(out) or self.run_dir()
            raise SnapshotError(_os_error_line(e, where)) from None
        try:
            size = write_atomic(path, partial(pickle.dump, snap))
        except OSError as e:
            raise SnapshotError(_os_error_line(e, path)) from None
        del snap  # the program's memory: a snapshot can be hundreds of MB
        meta = self._meta(kind, entries, size, session, oom)
        meta["timeline"] = timeline
        if modules is not None:
            meta["modules"] = modules
        meta["grads"] = session.grads.export() if session is not None and session.grads \
            else None
        sidecar = path + SIDECAR_SUFFIX
        try:
            data = json.dumps(meta, indent=1, default=str).encode()
            write_atomic(sidecar, lambda f: f.write(data))
        except OSError as e:
            note = (note + "; " if note else "") + "no sidecar: " + _os_error_line(e, sidecar)
            sidecar = None
        facts = {"ok": True, "path": path, "size": size, "entries": entries, "trigger": kind,
                 "simulated": bool(self.backend.simulated), "sidecar": sidecar,
                 "since": meta["since"], "until": meta["until"], "note": note}
        self.last = facts
        return facts

    # ---- commands -------------------------------------------------------------------------
    def start(self, args: dict, client_id: str = "local", owner=None) -> dict:
        """owner: the connection that asks (core.CommandContext.connection); the recording
        ends with it unless args["keep"]."""
        args = args or {}
        keep = bool(args.get("keep"))
        stacks = args.get("stacks") or "python"
        if stacks not in ("python", "all"):
            raise SnapshotError(f"stacks must be 'python' or 'all', not {str(stacks)[:40]!r}")
        max_entries = _pos_int(args.get("max_entries"), "max_entries", DEFAULT_MAX_ENTRIES,
                               MAX_ENTRIES_CAP)
        seconds = args.get("seconds")
        steps = args.get("steps")
        if seconds is not None:
            try:
                if isinstance(seconds, bool):
                    raise TypeError
                seconds = float(seconds)
            except (TypeError, ValueError, OverflowError):
                raise SnapshotError(f"seconds must be a number, not {str(seconds)[:40]!r}") \
                    from None
            # NaN fails both tests; a timer of 1e308 s would raise in its thread, never stop
            if not 0 < seconds <= MAX_SECONDS:
                raise SnapshotError(f"seconds must be greater than 0 and at most {MAX_SECONDS:g}"
                                    " (7 days)")
        if steps is not None:
            steps = _pos_int(steps, "steps", None, 10 ** 12)
        if seconds is not None and steps is not None:
            raise SnapshotError("give seconds or steps, not both")
        out = self._resolve_out(args.get("out"))
        who = args.get("who")
        if who is not None and not isinstance(who, str):
            raise SnapshotError("who must be a string")
        who = who[:200] if who else who
        with self.lock:
            if self.session is not None or self.dumping:
                s = self.session
                if s is None:
                    raise SnapshotError("a snapshot is being written; try again in a moment")
                label = s.who or s.by
                mine = " (you)" if s.by == client_id else ""
                raise SnapshotError(
                    f"already recording: started by {label}{mine} at "
                    f"{time.strftime('%H:%M:%S', time.localtime(s.since))} "
                    f"({time.time() - s.since:.0f} s ago); stop it with snapshot_stop "
                    f"(gpumon snapshot {os.getpid()} --stop)")
            why = self.backend.unavailable()
            if why:
                raise SnapshotError(why)
            # Fail now, not after ten minutes of recording, if the file can't be written.
            try:
                if out:
                    d = out if (os.path.isdir(out) or out.endswith(os.sep)) else (
                        os.path.dirname(out) or ".")
                    _check_writable_dir(d)
                else:
                    self._target_dir_check()
            except OSError as e:
                raise SnapshotError(_os_error_line(e, out or self.run_dir())) from None
            with history.LOCK:
                # the phases meter's trace-only history (on around a measured step) is not the
                # program's: this recording takes it over and restarts it with its settings
                temporary = history.take_over()
                try:
                    already = not temporary and self.backend.is_recording()
                except Exception as e:
                    raise SnapshotError(f"cannot read the recording state: {e}") from None
                user_recording = already and not self.flight_ours
                note = None
                if already:
                    note = ("allocation history was already on (started by the program): "
                            "gpumon uses it as it is and leaves it on") if user_recording else (
                            "the OOM flight recorder's history is used; it stays on")
                else:
                    try:
                        self.backend.start(stacks, max_entries)
                    except Exception as e:
                        if temporary:
                            self._safe_stop()
                        raise SnapshotError(
                            f"could not start recording: {_first_line(e)}") from None
                # from here on every entry is recorded with this recording's settings (the
                # meter's, still stackless, can come up to the restart: seen on the H100)
                started_us = int(time.time() * 1e6)
            s = _Session(client_id, who, time.time(), stacks, max_entries, seconds, steps, out,
                         ours=not already, user_recording=user_recording,
                         owner=None if keep else owner)
            if temporary:
                s.trace_from_us = started_us
            self.session = s
            mod = sys.modules.get("gpumon.agent.modules")
            if mod is not None and not getattr(self.backend, "simulated", False):
                mod.annotate_start()  # module enter/leave into the sidecar (never raises)
            if seconds is not None:
                s.timer = threading.Timer(seconds, self._auto_finish, args=(s, "seconds"))
                s.timer.daemon = True
                s.timer.start()
            self._hook_grads(s)
            if steps is not None:
                try:
                    s.hook = self.backend.register_step_hook(
                        lambda opt, *a, _s=s, **k: self._on_step(_s, opt))
                except Exception as e:
                    s.hook = None
                    note = (note + "; " if note else "") + f"cannot count steps: {e}"
                if s.hook is None:
                    self.session = None
                    if mod is not None:
                        mod.annotate_stop()
                    self._unhook_grads(s)
                    if s.ours:
                        self._safe_stop()
                    raise SnapshotError("cannot count optimizer steps here (no torch.optim "
                                        "global hooks); use seconds instead")
        payload = {"by": client_id, "who": who, "since": s.since, "stacks": stacks,
                   "max_entries": max_entries, "seconds": seconds, "steps": steps,
                   "keep": s.owner is None}
        self.broadcast("recording", state="started", **payload)
        if s.owner is not None and _connection_closed(s.owner):
            self.client_gone(s.owner)  # it went while this start ran (a blocking command)
        return {"recording": True, **payload, "user_recording": user_recording,
                "simulated": bool(self.backend.simulated), "note": note}

    def _target_dir_check(self):
        d = self.run_dir()
        try:
            _check_writable_dir(d)
        except OSError:
            # dump() will say it fell back
            _check_writable_dir(self._fallback_dir(), self._fallback_base())

    def stop(self, args: dict | None = None, client_id: str = "local",
             reason: str = "stop") -> dict:
        args = args or {}
        with self.lock:
            s = self.session
            if s is None:
                if self.dumping:
                    raise SnapshotError("a snapshot is being written already")
                raise SnapshotError(f"not recording: start one with `gpumon snapshot "
                                    f"{os.getpid()} --start` (or without --start: record "
                                    "until Enter)")
            out = args.get("out")
            if out:
                s.out = self._resolve_out(out)
        return self._finish(s, reason, by=client_id)

    def _finish(self, s: _Session, reason: str, by: str | None = None,
                kind: str = "manual") -> dict:
        with self.lock:
            if self.session is not s:  # finished by another path meanwhile
                raise SnapshotError("this recording has already ended")
            self.session = None
            self.dumping = True
            if s.timer is not None:
                s.timer.cancel()
            if s.hook is not None:
                try:
                    s.hook.remove()
                except Exception:
                    pass
                s.hook = None
            self._unhook_grads(s)
        try:
            facts = self.dump(kind, s.out, s)
        except BaseException as e:
            with self.lock:
                self.dumping = False
                still = self._is_recording_safe()
                if still and self.session is None and not self._closed:
                    self.session = s  # keep recording, so a retry loses nothing
                    if s.seconds is not None or s.steps is not None:
                        s.seconds = s.steps = None  # the retry is by hand now
            msg = str(e) if isinstance(e, SnapshotError) else f"snapshot failed: {_first_line(e)}"
            if still:
                msg += "; still recording, so nothing is lost: stop again (with another -o)"
            self.broadcast("snapshot", ok=False, path=None, error=msg, trigger=kind)
            raise SnapshotError(msg) from None
        with self.lock:
            self.dumping = False
            if s.ours and not self.flight_ours:
                self._safe_stop()
        facts["reason"] = reason
        facts["steps"] = s.steps_done if s.steps else None
        self.broadcast("recording", state="stopped", by=by or s.by, who=s.who, since=s.since,
                       until=facts["until"], reason=reason, path=facts["path"])
        self.broadcast("snapshot", **facts)
        return facts

    def client_gone(self, connection) -> None:
        """On the agent thread: a client's connection ended. Its recording (not one started
        with keep) is stopped and dumped now, in a thread (the dump may take seconds)."""
        s = self.session
        if s is not None and s.owner is not None and s.owner is connection:
            s.owner = None
            threading.Thread(target=self._auto_finish, args=(s, "client gone"),
                             name="gpumon-snapshot", daemon=True).start()

    def _auto_finish(self, s: _Session, reason: str) -> None:
        try:
            self._finish(s, reason, by=s.by)
        except SnapshotError as e:
            _log(f"auto stop ({reason}): {e}")
        except Exception as e:
            _log(f"auto stop ({reason}) failed: {e!r}")

    def _hook_grads(self, s: _Session) -> None:
        """Note the .grads every optimizer steps while this recording is on (grads.py): a
        global pre-hook, removed when the recording ends. Without it the snapshot is the same,
        its gradients only unnamed."""
        fn = getattr(self.backend, "register_grad_hook", None)
        if fn is None:
            return
        from gpumon.agent.grads import GradLog
        log = GradLog()
        try:
            s.grad_hook = fn(log.on_step_pre)
        except Exception as e:
            _log(f"grads: {e!r}")
            return
        if s.grad_hook is not None:
            s.grads = log

    @staticmethod
    def _unhook_grads(s: _Session) -> None:
        if s.grad_hook is not None:
            try:
                s.grad_hook.remove()
            except Exception:
                pass
            s.grad_hook = None

    def _on_step(self, s: _Session, optimizer) -> None:
        # Runs in the training thread after every optimizer.step(): O(1), never raises.
        try:
            if s.first_optimizer is None:
                s.first_optimizer = id(optimizer)
            elif id(optimizer) != s.first_optimizer:
                return  # count the steps of one optimizer (a GAN's two count as one loop)
            s.steps_done += 1
            if s.steps is not None and s.steps_done == s.steps:
                t = threading.Thread(target=self._auto_finish, args=(s, "steps"),
                                     name="gpumon-snapshot", daemon=True)
                t.start()
        except Exception:
            pass

    def status(self, args=None, client_id="local") -> dict:
        # Runs on the agent's thread: no lock (a start may hold it while probing a slow disk).
        s = self.session
        try:
            why = self.backend.unavailable()
        except Exception as e:
            why = _first_line(e)
        now = time.time()
        return {
            "recording": s is not None, "by": s.by if s else None,
            "who": s.who if s else None, "since": s.since if s else None,
            "elapsed": (now - s.since) if s else None,
            "seconds": s.seconds if s else None, "steps": s.steps if s else None,
            "steps_done": s.steps_done if s else None,
            "stacks": s.stacks if s else None, "dumping": self.dumping,
            "keep": (s.owner is None) if s else None,
            "oom_recorder": self.oom_enabled, "oom_dumps": self.oom_dumps,
            "available": why is None, "reason": why,
            "simulated": bool(self.backend.simulated), "last": self.last,
            "dir": self.run_dir(),
        }

    # ---- OOM flight recorder --------------------------------------------------------------
    def enable_oom(self) -> None:
        """Turn the flight recorder on (idempotent). Safe before torch is imported."""
        with self.lock:
            self.oom_enabled = True
        self.hook_cuda()

    def hook_cuda(self) -> None:
        """Arrange _on_cuda_ready to run once CUDA is initialised; poll for torch if needed."""
        with self.lock:
            if self._cuda_hooked:
                return
            self._cuda_hooked = True
        if self._try_hook():
            return
        t = threading.Thread(target=self._wait_for_torch, name="gpumon-snapshot-torch",
                             daemon=True)
        t.start()

    def _try_hook(self) -> bool:
        try:
            return bool(self.backend.when_cuda_ready(self._on_cuda_ready))
        except Exception as e:
            self._hook_errors = getattr(self, "_hook_errors", 0) + 1
            if self._hook_errors >= 20:
                _log(f"cannot hook CUDA init, giving up: {e!r}")
                return True
            return False  # e.g. torch half-imported: try again shortly

    def _wait_for_torch(self) -> None:
        t0 = time.monotonic()
        while not self._closed:
            if self.backend.kind != "torch":
                return
            if self._try_hook():
                return
            time.sleep(0.1 if time.monotonic() - t0 < 60 else 1.0)

    def _on_cuda_ready(self) -> None:
        # Called inside torch.cuda's lazy init (or at once): must never raise.
        try:
            if not self.observer_attached:
                self.observer_attached = bool(self.backend.attach_oom_observer(self._on_oom))
            if self.oom_enabled and not self.flight_ours:
                why = self.backend.unavailable(initialising=True)
                if why:
                    _log(f"OOM flight recorder off: {why}")
                    return
                with history.LOCK:
                    if history.take_over() or not self.backend.is_recording():
                        self.backend.start("python", self.oom_max_entries)
                        self.flight_ours = True
                        _log(f"OOM flight recorder on (max_entries={self.oom_max_entries})")
                    else:
                        _log("OOM flight recorder uses the program's own history")
        except BaseException as e:
            _log(f"OOM flight recorder setup failed: {e!r}")

    def _on_oom(self, device, requested, device_total, device_free) -> None:
        # torch calls this with the GIL held, before raising OutOfMemoryError. Never raise.
        try:
            if self._in_oom or self._closed:
                return
            self._in_oom = True
            now = time.time()
            try:
                figs = self.backend.memory_figures(int(device))
            except BaseException:
                figs = {"allocated": None, "reserved": None}
            oom = {"device": int(device), "requested": int(requested),
                   "device_total": int(device_total), "device_free": int(device_free),
                   "allocated": figs.get("allocated"), "reserved": figs.get("reserved"),
                   "time": now}
            path = err = None
            if not self.oom_enabled:
                err = "no snapshot: the OOM flight recorder is off (gpumon run --oom-snapshot)"
            elif self.oom_dumps >= self.oom_max_dumps:
                err = f"no snapshot: already wrote {self.oom_dumps} OOM snapshots in this process"
            else:
                self.oom_dumps += 1
                try:
                    facts = self.dump("oom", None, self.session, oom=oom)
                    path = facts["path"]
                except BaseException as e:
                    err = str(e) if isinstance(e, SnapshotError) else _first_line(e)
            self.broadcast("oom", device=oom["device"], requested=oom["requested"],
                           device_total=oom["device_total"], free=oom["device_free"],
                           allocated=oom["allocated"], reserved=oom["reserved"],
                           time=now, path=path, error=err)
            if path:
                self.broadcast("snapshot", **self.last)
        except BaseException as e:
            try:
                _log(f"OOM observer failed: {e!r}")
            except BaseException:
                pass
        finally:
            self._in_oom = False

    # ---- lifecycle ------------------------------------------------------------------------
    def at_exit(self) -> None:
        """The process is exiting: dump a recording in progress, tell clients."""
        try:
            s = self.session
            if s is not None:
                try:
                    self._finish(s, "exit", by=s.by, kind="exit")
                except SnapshotError as e:
                    _log(f"at exit: {e}")
            self._closed = True
        except BaseException as e:
            _log(f"at exit failed: {e!r}")

    def after_fork_in_child(self) -> None:
        # The child (a DataLoader worker) records nothing and owns nothing of the parent's.
        self.session = None
        self.dumping = False
        self.flight_ours = False
        self.oom_enabled = False
        self._closed = True
        self.lock = threading.RLock()

    def _safe_stop(self) -> None:
        try:
            self.backend.stop()
        except Exception as e:
            _log(f"stop recording failed: {e!r}")

    def _is_recording_safe(self) -> bool:
        try:
            return bool(self.backend.is_recording())
        except Exception:
            return False


def _connection_closed(connection) -> bool:
    """The agent closes a client's socket when its connection ends."""
    try:
        return connection.sock.fileno() < 0
    except Exception:
        return False


def _env_int(name: str, default: int) -> int:
    try:
        v = int(os.environ.get(name, ""))
        return v if v > 0 else default
    except ValueError:
        return default


def _pos_int(v, name, default, top):
    if v is None:
        return default
    if isinstance(v, bool):
        raise SnapshotError(f"{name} must be a positive integer")
    if isinstance(v, str) and v.strip().isdigit() and len(v) <= 20:
        v = int(v)
    if not isinstance(v, int) or not 0 < v <= top:
        raise SnapshotError(f"{name} must be a positive integer up to {top}, not "
                            f"{str(v)[:40]}")
    return v


def _agent_version():
    try:
        from gpumon import __version__
        return __version__
    except Exception:
        return None


def _first_line(e: BaseException) -> str:
    s = str(e).strip().splitlines()
    return s[0] if s else type(e).__name__


def _choose_backend(agent):
    source = getattr(agent, "source", None)
    if getattr(source, "kind", None) == "simulated":
        return SimulatedBackend(source)
    return TorchBackend()


def oom_snapshot_requested(agent=None) -> bool:
    if getattr(agent, "oom_snapshot", False):
        return True
    return os.environ.get("GPUMON_OOM_SNAPSHOT", "").strip().lower() in ("1", "true", "yes", "on")


# --------------------------------------------------------------------------------------------
# Installation into the agent
# --------------------------------------------------------------------------------------------

_recorder: Recorder | None = None
_install_lock = threading.Lock()


def recorder() -> Recorder | None:
    return _recorder


def install(agent) -> Recorder:
    """Called by the core agent at start. Registers the commands; idempotent."""
    global _recorder
    with _install_lock:
        if _recorder is not None and _recorder.agent is agent:
            return _recorder
        from gpumon.agent import core
        rec = Recorder(agent)
        _recorder = rec

        def wrap(method, owned=False):
            def fn(args, ctx):
                kw = {"owner": getattr(ctx, "connection", None)} if owned else {}
                try:
                    return method(args or {}, getattr(ctx, "client_id", "local"), **kw)
                except SnapshotError as e:
                    raise core.CommandError(str(e)) from None
            return fn

        core.register_command("snapshot_start", wrap(rec.start, owned=True), blocking=True)
        core.register_command("snapshot_stop", wrap(rec.stop), blocking=True)
        core.register_command("snapshot_status", wrap(rec.status), blocking=False)
        core.register_client_gone(rec.client_gone)
        atexit.register(rec.at_exit)
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=rec.after_fork_in_child)
        if rec.backend.kind == "torch":
            rec.hook_cuda()  # attach the OOM observer (a no-op unless enabled) once CUDA is up
        if oom_snapshot_requested(agent):
            rec.enable_oom()
        return rec


def enable_oom_snapshot() -> bool:
    """Turn on the OOM flight recorder of the running agent. False if no agent runs."""
    rec = _recorder
    if rec is None:
        return False
    rec.enable_oom()
    return True
