"""`gpumon estimate ... --check PID`: attach to a running process's agent, wait for completed
training steps, and compare the estimate with what the run measured (compare.py), without the TUI.

Talks to the agent through gpumon.client (standard library + psutil; no torch, no textual).
The agent's phases part sends a `breakdown` event at every phase boundary of the first steps
and about once a second later; each carries the roles at the end of the phase that just ended
(`now`) and the run's peak (`run_peak`, `run_peak_phase`). The check keeps the roles of each
phase end, waits until `min_steps` steps have completed (step 2 is the first with optimizer
state through the whole step) and the roles at the end of the run's peak phase are known, then
compares.
"""
from __future__ import annotations

import time
from typing import Any, Callable

from .compare import Comparison, compare_device, estimate_peak_phase


class CheckError(RuntimeError):
    """The live check could not be made (one line)."""


def _main_device(devices: dict) -> Any:
    if not devices:
        return None
    return max(devices, key=lambda k: (devices[k].get("run_peak") or 0, devices[k].get("allocated") or 0))


def check_live(estimate: Any, pid: int, timeout: float = 120.0, min_steps: int = 2,
               progress: Callable[[str], None] | None = None) -> tuple[Comparison, dict]:
    """Attach to pid's agent, wait, compare. Returns (comparison, info) where info has the
    device index, steps seen and the breakdown device dict used. Raises CheckError."""
    from gpumon import client
    try:
        client.check_pid(pid)
        conn = client.connect(pid, timeout=5.0)  # else one line: waiting for CUDA, no agent...
    except (client.AttachError, client.AgentError, OSError) as e:
        raise CheckError(str(e)) from None
    est = estimate.to_dict() if hasattr(estimate, "to_dict") else estimate
    est_phase = estimate_peak_phase(est)
    devices: dict = {}                 # index -> latest breakdown device dict
    ends: dict = {}                    # index -> {phase: roles at that phase's end}
    steps_done = 0
    deadline = time.monotonic() + timeout
    last_status = 0.0

    def take(bd: dict | None) -> None:
        if not bd:
            return
        for dev in bd.get("devices") or ():
            i = dev.get("index")
            devices[i] = dev
            if bd.get("phase") and dev.get("now"):
                ends.setdefault(i, {})[bd["phase"]] = dev["now"]

    def ready() -> bool:
        if steps_done < min_steps or not devices:
            return False
        dev = devices[_main_device(devices)]
        phase = dev.get("run_peak_phase") or est_phase
        got = ends.get(dev.get("index"), {})
        return (phase in got or bool(dev.get("at_run_peak"))
                or (dev.get("at_peak") is not None and dev.get("peak_phase") == phase))

    said = None
    known = False  # the first phases_status answered

    def say() -> None:
        """What it waits for now, each time that changes (every wait of this command is
        said: a check on a model still building waited 40 s without a word)."""
        nonlocal said
        if not progress or not known:
            return
        if steps_done < min_steps:
            what = (f"waiting for {min_steps} completed training steps "
                    f"({steps_done} of {min_steps} so far, up to {timeout:g} s: --timeout)")
        else:  # no running count here: one line, not one a step
            what = (f"{min_steps} or more steps completed; waiting for a breakdown at the end "
                    f"of the peak phase ({est_phase or 'the run peak'})")
        if what != said:
            said = what
            progress(f"pid {conn.hello.get('pid')}: {what}")

    try:
        with conn:
            while not ready():
                now = time.monotonic()
                if now > deadline:
                    break
                if now - last_status > 1.0:
                    last_status = now
                    try:
                        st = conn.request("phases_status", timeout=5.0)
                    except client.AgentError as e:
                        if "unknown command" in str(e).lower():
                            raise CheckError("this agent has no phases support (an older gpumon?)") from None
                        st = {}
                    steps_done = max(steps_done, int(st.get("steps_done") or 0))
                    take(st.get("last_breakdown"))
                    if steps_done >= min_steps and not ready():
                        # unasked breakdowns come once in ~20 s (0.02% of the program's
                        # time): ask for one at the next phase boundary (asked ones keep to
                        # ~0.5%), until one ends the peak phase
                        try:
                            take(conn.request("phases_breakdown", {"wait": 0.5}, timeout=5.0))
                        except client.AgentError:
                            pass
                    known = True  # the steps already done: said from here on
                say()
                try:
                    msg = conn.recv(timeout=0.5)
                except TimeoutError:
                    continue
                if msg is None:
                    raise CheckError(f"process {pid} went away before {min_steps} steps completed")
                if msg.get("type") != "event":
                    continue
                if msg.get("kind") == "step":
                    steps_done = max(steps_done, int(msg.get("step") or 0))
                elif msg.get("kind") == "breakdown":
                    take(msg)
    except client.AgentError as e:
        raise CheckError(str(e)) from None
    if steps_done < min_steps or not devices:
        raise CheckError(f"only {steps_done} training step(s) completed in {timeout:g} s (need {min_steps}); "
                         "is the process training (forward, backward, optimizer.step())?")
    idx = _main_device(devices)
    dev = devices[idx]
    # the phase ready() waited for: the run's peak phase, else the estimate's
    comp = compare_device(est, dev, ends.get(idx), fallback_phase=est_phase)
    if not ready():
        comp.notes.append("the roles at the end of the peak phase were not seen in time: taken from the "
                          "latest breakdown")
    return comp, {"device": idx, "steps": steps_done, "breakdown": dev, "phase_ends": ends.get(idx, {})}
