"""The top modules at the peak, from the last per-module measurement (``m`` in the live view,
or ``gpumon modules PID``): shown in the breakdown. Only renders a
gpumon.model.modules.ModuleReport."""
from __future__ import annotations

from rich.text import Text

from gpumon.model.modules import ROOT_LABEL, fmt_bytes
from gpumon.tui.format import hanging

TOP_K = 5


def modules_text(report, error: str | None, pending: bool, width: int, key: str = "m",
                 k: int = TOP_K) -> Text:
    t = Text()
    if pending:
        t.append("modules: measuring the next step(s)...\n", style="yellow")
    if error:
        t.append(f"modules: {error}\n", style="yellow")
    if report is None:  # nothing until asked (the help names the key)
        return t
    stack = report.peak_module()
    head = "modules at the peak" if report.peak is not None else "modules"
    t.append(head, style="bold")
    if report.peak is not None:
        t.append(f": {fmt_bytes(report.peak)} in {report.peak_phase}, running "
                 f"{stack or 'no module'}")
    st = report.step_time
    meas = st.get("measured") or []
    if st.get("before") and meas:
        t.append(f"  (step {st['before'] * 1000:.0f} ms, measured {max(meas) * 1000:.0f} ms)",
                 style="dim")
    t.append(f"  [{key}: again]\n", style="dim")
    if str(report.device) == "cpu":  # the demo, a simulated source: its GPU figures are scripted
        t.append(hanging("  measured on the CPU: the program's own model (the figures above "
                         "are the simulated source's)", width, "    ") + "\n", style="dim")
    if report.note:
        t.append(hanging(f"  note: {report.note}", width, "    ") + "\n", style="yellow")
    name_w = max(16, width - 48)
    rows = report.top(k)
    if rows:  # what the columns are (a new user read three bare numbers)
        t.append(f"  {'module':<{name_w}} {'holds':>9}  P params+buffers  A activations\n",
                 style="dim")
    for row in rows:
        name = row.label
        if len(name) > name_w:
            name = "…" + name[-(name_w - 1):]
        t.append(f"  {name:<{name_w}}", style="bold" if row.path == (report.peak_stack or
                                                                        [None])[-1] else "")
        t.append(f" {fmt_bytes(row.own):>9}  P {fmt_bytes(row.params + row.buffers):>9}"
                 f"  A {fmt_bytes(row.act_at_peak + row.bwd_at_peak):>9}\n")
    return t


__all__ = ["modules_text", "ROOT_LABEL"]
