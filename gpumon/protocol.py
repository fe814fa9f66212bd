"""The wire format between the in-process agent and its clients, in one place.

Framing: one JSON object per line (UTF-8, ``\\n``-terminated), at most ``MAX_MESSAGE_BYTES``
per line. Plain data only: never pickle on the wire. Standard library only, because the agent
imports this module inside the training process (and may be injected where gpumon is not
installed).

Server -> client messages (``type``):
  hello    first message on every connection (see ``HELLO_FIELDS``)
  history  ``{"type": "history", "samples": [sample, ...], "last": bool}``; the recent ring,
           oldest first, in chunks; the chunk with ``last: true`` ends the history
  sample   one sample (see ``SAMPLE_FIELDS`` / ``DEVICE_FIELDS``)
  event    ``{"type": "event", "kind": str, ...payload}``: oom, snapshot, phase, breakdown, ...
  reply    ``{"type": "reply", "id": int, "ok": bool, "result": {...}}`` or
           ``{"type": "reply", "id": int, "ok": false, "error": "one line"}``
  error    ``{"type": "error", "error": "one line"}``: the agent could not parse what the client
           sent (bad JSON, too long, wrong version); the agent keeps serving
Client -> server messages:
  cmd      ``{"v": VERSION, "type": "cmd", "id": int, "cmd": str, "args": {...}}``
"""
from __future__ import annotations

import json
import math
import operator
import re
from typing import Any

VERSION = 1
MAX_MESSAGE_BYTES = 4 * 1024 * 1024
HISTORY_CHUNK = 500  # samples per history message

# Fields of the hello message. Values that can't be known are null, never missing.
HELLO_FIELDS = (
    "v", "type", "pid", "ppid", "argv", "cwd", "hostname", "start_time", "python", "torch",
    "devices",       # [{"index", "name", "total", "uuid"}]
    "rank", "local_rank", "world_size",
    "allocator",     # {"backend", "conf", "expandable_segments"}
    "source",        # "torch" | "simulated"
    "rate_hz", "agent_version", "commands", "nvml",  # nvml: null or an error string if unavailable
)

# Fields of one sample message.
SAMPLE_FIELDS = (
    "type", "seq", "t",  # t: unix time (s) when the sample was taken
    "cost_us",           # agent time spent taking this sample, all devices together
    "devices",           # [device figures]
    "phase", "step",     # from the phase tracker when present, else null
)

# Per-device figures inside a sample, bytes unless said otherwise; null when unavailable.
DEVICE_FIELDS = (
    "index",
    "allocated", "reserved", "active", "requested", "inactive_split",
    "peak_allocated", "peak_reserved", "peak_active",
    "segments", "alloc_retries", "ooms", "device_alloc", "device_free",  # counts
    "nvml_used", "nvml_total",  # whole device, from NVML
    "proc_used",                # this process on this device, from NVML's process list
)


class ProtocolError(ValueError):
    """A message that can't be decoded or is not of this protocol version."""


def encode(msg: dict[str, Any]) -> bytes:
    """One message as a framed line. Raises ProtocolError if it is too long."""
    data = json.dumps(msg, separators=(",", ":"), allow_nan=False).encode()
    if len(data) >= MAX_MESSAGE_BYTES:
        raise ProtocolError(f"message of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
    return data + b"\n"


# The sample is the one message sent ten times a second for the life of a training run: it is
# written from a template (about 2 us where json.dumps takes 5-6, measured) whenever it has
# exactly the protocol's fields and every figure is a plain int or null; anything else (a
# sample extra with its own keys, an odd type from an old torch) goes through json.
_SAMPLE_TEMPLATE = ('{"type":"sample","seq":%d,"t":%r,"cost_us":%r,"devices":[%s],'
                    '"phase":%s,"step":%s}')
_DEVICE_TEMPLATE = "{" + ",".join(f'"{f}":%s' for f in DEVICE_FIELDS) + "}"
_device_values = operator.itemgetter(*DEVICE_FIELDS)
_PLAIN = frozenset((int, type(None)))
_SAMPLE_KEYS = frozenset(SAMPLE_FIELDS)
_n_device_fields = len(DEVICE_FIELDS)
_phase_json: dict[str, str] = {}


def _finite_float(x: Any) -> bool:
    return type(x) is float and math.isfinite(x)


def encode_sample(msg: dict[str, Any]) -> bytes:
    """A sample message as JSON (no newline; the agent's ring keeps it so). Equal, once
    decoded, to ``encode(msg)``; raises ProtocolError if it is too long, and TypeError or
    ValueError if it is not plain data."""
    if msg.keys() != _SAMPLE_KEYS or type(msg["seq"]) is not int \
            or not _finite_float(msg["t"]) or not _finite_float(msg["cost_us"]):
        return encode(msg)[:-1]
    phase, step = msg["phase"], msg["step"]
    if phase is None:
        phase_json = "null"
    elif type(phase) is str:
        phase_json = _phase_json.get(phase)
        if phase_json is None:
            phase_json = json.dumps(phase)
            if len(_phase_json) < 64:  # the tracker's few labels; never grows without bound
                _phase_json[phase] = phase_json
    else:
        return encode(msg)[:-1]
    if type(step) not in _PLAIN:
        return encode(msg)[:-1]
    parts = []
    for d in msg["devices"]:
        if type(d) is not dict or len(d) != _n_device_fields:
            return encode(msg)[:-1]
        try:
            values = _device_values(d)
        except KeyError:
            return encode(msg)[:-1]
        if not set(map(type, values)) <= _PLAIN:
            return encode(msg)[:-1]
        parts.append(_DEVICE_TEMPLATE % values)
    data = (_SAMPLE_TEMPLATE % (msg["seq"], msg["t"], msg["cost_us"],
                                ",".join(parts).replace("None", "null"), phase_json,
                                "null" if step is None else step)).encode()
    if len(data) >= MAX_MESSAGE_BYTES:
        raise ProtocolError(f"message of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
    return data


# What any decoded message may hold, whoever sent it: nesting (a deep line would make the C
# parser recurse: a RecursionError, or a C stack overflow in a program that raised its
# recursion limit), finite numbers only, integers of at most MAX_INT_DIGITS digits (a
# million-digit literal takes seconds to convert where the program lifted Python's limit).
MAX_DEPTH = 32
MAX_INT_DIGITS = 40
_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"')
_INNERMOST = re.compile(r"\[[^\[\]{}]*\]|\{[^\[\]{}]*\}")
_LONG_DIGITS = re.compile(r"\d{%d}" % (MAX_INT_DIGITS + 1), re.ASCII)


def _too_deep(text: str) -> bool:
    """True if text nests arrays/objects deeper than MAX_DEPTH. Fast for the usual message
    (fewer brackets than the limit); otherwise at most MAX_DEPTH regex passes, no recursion.
    Exact for any text json.loads accepts (its strings are removed first, by JSON's own rule;
    json.loads gets the same str, never bytes, whose UTF-16 guess would change the lexing)."""
    if text.count("[") + text.count("{") <= MAX_DEPTH:
        return False
    s = _STRINGS.sub("", text)
    for _ in range(MAX_DEPTH):
        s, n = _INNERMOST.subn("", s)
        if not n:
            break
    return "[" in s or "{" in s


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number this protocol allows")


def _finite(text: str) -> float:
    x = float(text)
    if not math.isfinite(x):
        raise ValueError(f"number {text[:20]} is out of range")
    return x


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise ValueError(f"integer of {len(text)} digits (at most {MAX_INT_DIGITS})")
    return int(text)


def decode(line: bytes) -> dict[str, Any]:
    """One framed line (with or without its newline) to a message dict. Any byte sequence
    either gives a dict of plain data (nesting at most MAX_DEPTH, finite numbers, integers of
    at most MAX_INT_DIGITS digits) or raises ProtocolError; nothing else escapes."""
    if len(line) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"message longer than {MAX_MESSAGE_BYTES} bytes")
    try:
        text = line.decode() if isinstance(line, (bytes, bytearray)) else str(line)
        if _too_deep(text):
            raise ProtocolError(f"message nested deeper than {MAX_DEPTH} levels")
        kw: dict[str, Any] = {"parse_constant": _no_constant, "parse_float": _finite}
        if _LONG_DIGITS.search(text):
            kw["parse_int"] = _bounded_int
        msg = json.loads(text, **kw)
    except ProtocolError:
        raise
    except (UnicodeDecodeError, ValueError, RecursionError, TypeError) as e:
        raise ProtocolError(f"not a JSON message: {str(e)[:200]}") from None
    if not isinstance(msg, dict) or not isinstance(msg.get("type"), str):
        raise ProtocolError("message is not an object with a string 'type'")
    return msg


def is_version(v: Any) -> bool:
    """The protocol version field: an integer (not a bool: ``true == 1`` in Python) equal to
    VERSION."""
    return type(v) is int and v == VERSION


class LineReader:
    """Splits a byte stream into framed lines, refusing any line over the size limit: feed()
    raises ProtocolError (with the complete lines before it in ``.lines``) and the rest of
    that line is skipped up to its newline, so one overlong line costs one error."""

    def __init__(self, limit: int = MAX_MESSAGE_BYTES) -> None:
        self._buf = bytearray()
        self._limit = limit
        self._skipping = False  # inside an overlong line: drop bytes up to its newline

    def feed(self, data: bytes) -> list[bytes]:
        """The complete lines in data (after what came before), empty ones included. Splits in
        C (bytes.split): a megabyte of newlines costs no Python loop."""
        if self._skipping:
            i = data.find(b"\n")
            if i < 0:
                return []
            data = data[i + 1:]
            self._skipping = False
        if b"\n" not in data:
            self._buf += data
            lines: list[bytes] = []
            overlong = False
        else:
            lines = (bytes(self._buf) + data).split(b"\n")
            self._buf = bytearray(lines.pop())
            n = len(lines)
            if max(map(len, lines)) > self._limit:
                lines = [x for x in lines if len(x) <= self._limit]
            overlong = len(lines) != n
        if len(self._buf) > self._limit:
            self._buf.clear()
            self._skipping = overlong = True
        if overlong:
            e = ProtocolError(f"message longer than {self._limit} bytes")
            e.lines = lines
            raise e
        return lines


def command(msg_id: int, cmd: str, args: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"v": VERSION, "type": "cmd", "id": msg_id, "cmd": cmd, "args": args or {}}


def check_hello(msg: dict[str, Any]) -> dict[str, Any]:
    """Validate a hello from an agent; a different version is a clear error."""
    if msg.get("type") != "hello":
        raise ProtocolError(f"expected hello, got {msg.get('type')!r}")
    if not is_version(msg.get("v")):
        raise ProtocolError(
            f"agent speaks protocol v{msg.get('v')}, this gpumon speaks v{VERSION}: "
            "use the same gpumon version on both sides")
    return msg
