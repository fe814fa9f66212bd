"""The wire decoder against any byte sequence (issue 22, item 2): it returns plain data or
raises ProtocolError, and its nesting check, done without recursion before json parses, is
never fooled into letting json recurse deeper than MAX_DEPTH (in a program that raised its
recursion limit, that recursion overflows the C stack: SIGSEGV)."""
import json
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpumon import protocol
from gpumon.protocol import MAX_DEPTH, ProtocolError, decode

# Lines made of what the check must get right: brackets, quotes, escapes.
TRICKY = st.text(alphabet='[]{}"\\,:1 ant/u', max_size=300).map(str.encode)


def json_depth(x):
    """Nesting of a decoded value, iteratively."""
    best, stack = 0, [(x, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, (list, dict)):
            best = max(best, d)
            stack.extend((c, d + 1) for c in (v.values() if isinstance(v, dict) else v))
    return best


@settings(max_examples=400, deadline=None)
@given(st.one_of(st.binary(max_size=300), TRICKY,
                 TRICKY.map(lambda b: b'{"type": "x", "a": ' + b)))
def test_any_bytes_give_a_message_or_a_protocol_error(line):
    try:
        msg = decode(line)
    except ProtocolError:
        return
    assert isinstance(msg, dict) and isinstance(msg["type"], str)
    assert json_depth(msg) <= MAX_DEPTH


@settings(max_examples=400, deadline=None)
@given(st.integers(0, 40), st.integers(0, 40), TRICKY, TRICKY)
def test_the_check_bounds_how_deep_json_recurses(opens, closes, head, tail):
    """Whatever the check lets through, json parses within MAX_DEPTH + a few frames: run
    json under a recursion limit just above that (a RecursionError would mean json went
    deeper than the check saw)."""
    line = head + b"[" * opens + tail + b"]" * closes
    if protocol._too_deep(line):
        return
    depth = len(_frames())  # frames in use here
    old = sys.getrecursionlimit()
    sys.setrecursionlimit(depth + MAX_DEPTH + 15)
    try:
        try:
            json.loads(line.decode("utf-8", "replace"))
        except RecursionError:
            pytest.fail(f"json recursed deeper than the check saw: {line[:120]!r}")
        except ValueError:
            pass
    finally:
        sys.setrecursionlimit(old)


def _frames():
    f, n = sys._getframe(0), []
    while f is not None:
        n.append(f)
        f = f.f_back
    return n


@pytest.mark.parametrize("depth", [MAX_DEPTH - 1, MAX_DEPTH, MAX_DEPTH + 1, 5000])
def test_nesting_up_to_the_limit_is_allowed_and_past_it_refused(depth):
    # (the outer object is one level)
    line = b'{"type": "x", "a": ' + b'["[", "\\\\", "\\"", ' * (depth - 1) + b"1" + b"]" * (depth - 1) + b"}"
    if depth <= MAX_DEPTH:
        assert json_depth(decode(line)) == depth
    else:
        with pytest.raises(ProtocolError, match="nested deeper"):
            decode(line)
