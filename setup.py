"""Only here to ship ``gpumon-autostart.pth`` (everything else is in pyproject.toml).

The .pth goes to the root of site-packages, where site.py runs its one line at every
interpreter start; the line does nothing unless GPUMON is set (gpumon/agent/bootstrap.py).
setuptools has no declarative way to put a file at the wheel root, hence this build_py.
"""
import ast
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent


def _pth() -> tuple[str, str]:
    """PTH_NAME and PTH_LINE from bootstrap.py, read without importing gpumon."""
    tree = ast.parse((HERE / "gpumon" / "agent" / "bootstrap.py").read_text())
    found = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            name = getattr(node.targets[0], "id", None)
            if name in ("PTH_NAME", "PTH_LINE"):
                found[name] = ast.literal_eval(node.value)
    return found["PTH_NAME"], found["PTH_LINE"]


class build_py_with_pth(build_py):
    def run(self):
        super().run()
        name, line = _pth()
        if getattr(self, "editable_mode", False):
            # An editable wheel is assembled from install_lib, not build_lib.
            target = Path(self.get_finalized_command("install").install_lib)
        else:
            target = Path(self.build_lib)
        target.mkdir(parents=True, exist_ok=True)
        (target / name).write_text(line)

    def get_outputs(self, include_bytecode=True):
        outs = super().get_outputs(include_bytecode)
        if not getattr(self, "editable_mode", False):
            outs.append(str(Path(self.build_lib) / _pth()[0]))
        return outs


setup(cmdclass={"build_py": build_py_with_pth})
