"""Plain commands show progress (Rich's own spinner and elapsed time, on stderr) for work that
takes seconds, only on a terminal: piped output stays exactly as it was."""
from pathlib import Path

from gpumon.commands.args import progress

SNAP = Path(__file__).resolve().parents[1] / "fixtures" / "snapshots" / "transformer.pickle"


def test_no_terminal_no_progress(capsys):
    with progress("working"):
        pass
    out, err = capsys.readouterr()
    assert out == "" and err == ""




def _spy(monkeypatch):
    """Replace the progress helper with one that records what it was asked to say and
    whether the work ran inside it."""
    import contextlib

    from gpumon.commands import args as args_mod
    said: list = []
    inside = {"n": 0}

    @contextlib.contextmanager
    def fake(text):
        said.append(text)
        inside["n"] += 1
        try:
            yield
        finally:
            inside["n"] -= 1
    monkeypatch.setattr(args_mod, "progress", fake)
    return said, inside


def test_estimate_measure_runs_inside_a_progress(monkeypatch, capsys, tmp_path):
    """`estimate --measure` (20 s of silence before, issue 20): the measurement runs inside
    the spinner, which says what it does."""
    import argparse

    from gpumon.commands import estimate as cmd
    from gpumon.estimate import measure as measure_mod
    said, inside = _spy(monkeypatch)
    seen = []

    def fake_measure(*a, **kw):
        seen.append(inside["n"])
        raise measure_mod.MeasureError("stop here")
    monkeypatch.setattr(measure_mod, "preflight", lambda **kw: None)
    monkeypatch.setattr(measure_mod, "measure_activations", fake_measure)
    p = argparse.ArgumentParser(prog="gpumon")
    cmd.register(p.add_subparsers(dest="command"))
    a = p.parse_args(["estimate", "--model", "m:f", "--measure"])
    assert a.func(a) == 1 and "stop here" in capsys.readouterr().err
    assert seen == [1] and said and said[0].startswith("measuring the activations")


def test_inject_and_detach_run_inside_a_progress(monkeypatch, capsys, tmp_path):
    """gdb takes seconds to attach: `gpumon inject` and `detach` say what they do meanwhile."""
    import argparse

    from gpumon import inject as inject_mod
    from gpumon.commands import inject as cmd
    said, inside = _spy(monkeypatch)
    seen = []

    def fake(pid, **kw):
        seen.append(inside["n"])
        return tmp_path / "1.sock"
    monkeypatch.setattr(inject_mod, "inject", fake)
    monkeypatch.setattr(inject_mod, "detach", fake)
    assert cmd.cmd_inject(argparse.Namespace(pid=4242, timeout=None, source=None)) == 0
    assert cmd.cmd_detach(argparse.Namespace(pid=4242, timeout=None)) == 0
    assert seen == [1, 1]
    assert said == ["loading the agent into process 4242", "stopping the agent in process 4242"]
