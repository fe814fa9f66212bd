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


