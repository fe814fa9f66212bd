"""Poll for a condition instead of sleeping a fixed time (tests run on loaded 2-core CI)."""
import time


def wait_until(fn, timeout=10.0, interval=0.05):
    """fn()'s first truthy value, or its last (falsy) value once timeout seconds have passed."""
    end = time.monotonic() + timeout
    while True:
        v = fn()
        if v or time.monotonic() > end:
            return v
        time.sleep(interval)


def wait_for(fn, timeout=20.0, interval=0.02, what="condition"):
    """fn()'s first truthy value; AssertionError naming `what` after timeout seconds."""
    v = wait_until(fn, timeout, interval)
    if not v:
        raise AssertionError(f"timed out waiting for {what}")
    return v
