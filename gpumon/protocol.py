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
    "rank", "local_rank", "world_size",  # RANK..., else SLURM_PROCID..., OMPI_*, PMI_* (jobenv)
    "job_id",        # SLURM_JOB_ID, else the Kubernetes pod; null outside a job
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
_NOT_STRUCTURE = bytes(c for c in range(256) if c not in b'[]{}"')
_STRING = re.compile(rb'"[^"]*"')
_INNERMOST = re.compile(rb"\[\]|\{\}")
_DIGITS = bytes(48 if 48 <= c <= 57 else 32 for c in range(256))  # digits -> 0, else space
_LONG_RUN = b"0" * (MAX_INT_DIGITS + 1)


def _too_deep(line: bytes) -> bool:
    """True if line nests arrays/objects deeper than MAX_DEPTH, without recursion: the usual
    message has fewer brackets than the limit; otherwise strings are removed (escaped
    backslashes and quotes first, so every quote left opens or closes one), everything but
    brackets dropped, and innermost pairs removed MAX_DEPTH times: what is left nests
    deeper. Exact over any prefix json.loads accepts (in UTF-8 a quote or backslash byte is
    never part of another character), so json never recurses deeper than this saw."""
    if line.count(b"[") + line.count(b"{") <= MAX_DEPTH:
        return False
    t = line.replace(b"\\\\", b"").replace(b'\\"', b"").translate(None, _NOT_STRUCTURE)
    t = _STRING.sub(b"", t)
    for _ in range(MAX_DEPTH):
        t, n = _INNERMOST.subn(b"", t)
        if not n:
            break
    return bool(t)


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


# Built once: json.loads with any option builds a decoder per call (~20 us).
_DECODER = json.JSONDecoder(parse_constant=_no_constant, parse_float=_finite)
_DECODER_INTS = json.JSONDecoder(parse_constant=_no_constant, parse_float=_finite,
                                 parse_int=_bounded_int)


def decode(line: bytes) -> dict[str, Any]:
    """One framed line (with or without its newline) to a message dict. Any byte sequence
    either gives a dict of plain data (nesting at most MAX_DEPTH, finite numbers, integers of
    at most MAX_INT_DIGITS digits) or raises ProtocolError; nothing else escapes."""
    if len(line) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"message longer than {MAX_MESSAGE_BYTES} bytes")
    try:
        line = bytes(line) if isinstance(line, (bytes, bytearray)) else str(line).encode()
        if _too_deep(line):
            raise ProtocolError(f"message nested deeper than {MAX_DEPTH} levels")
        # str, not bytes: json.loads would guess UTF-16/32 from the bytes and lex differently
        text = line.decode()
        long_ints = _LONG_RUN in line.translate(_DIGITS)  # (a regex takes 10x as long)
        msg = (_DECODER_INTS if long_ints else _DECODER).decode(text)
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
