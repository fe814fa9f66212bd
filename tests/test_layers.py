"""The layers stay apart: model/, snapshot/, estimate/ and protocol.py import neither Textual
nor torch (they run where neither is installed), and the agent, which lives inside the training
process, imports nothing of the UI. Checked three ways: import-linter's contracts (pyproject),
a static read of every import statement, and a fresh interpreter that imports each layer."""
import ast
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "gpumon"
PURE = [PKG / "model", PKG / "snapshot", PKG / "estimate", PKG / "protocol.py"]
PURE_FORBIDDEN = ("textual", "torch")
AGENT = PKG / "agent"
AGENT_FORBIDDEN = ("textual", "gpumon.tui", "gpumon.model")


def files(*paths):
    for p in paths:
        yield from ([p] if p.is_file() else sorted(p.rglob("*.py")))


def module_name(path):
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(path, module_level_only, module=None):
    """(line, imported module) for each import in the file; relative imports resolved.
    module_level_only: skip imports inside functions (they run only when called)."""
    tree = ast.parse(path.read_text(), str(path))
    pkg = (module or module_name(path)).split(".")
    if path.name != "__init__.py":
        pkg = pkg[:-1]

    def walk(node, in_function):
        for child in ast.iter_child_nodes(node):
            is_fn = isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import) and not (module_level_only and in_function):
                for a in child.names:
                    yield child.lineno, a.name
            elif isinstance(child, ast.ImportFrom) and not (module_level_only and in_function):
                base = child.module or ""
                if child.level:
                    base = ".".join(pkg[: len(pkg) - child.level + 1] + ([base] if base else []))
                yield child.lineno, base
                for a in child.names:  # `from gpumon import tui` imports gpumon.tui
                    yield child.lineno, f"{base}.{a.name}"
            yield from walk(child, in_function or is_fn)

    return list(walk(tree, False))


def hits(name, forbidden):
    return any(name == f or name.startswith(f + ".") for f in forbidden)


def test_pure_layers_import_neither_textual_nor_torch_at_module_level():
    bad = [f"{p.relative_to(ROOT)}:{line} imports {name}"
           for p in files(*PURE) for line, name in imports(p, module_level_only=True)
           if hits(name, PURE_FORBIDDEN)]
    assert not bad, "\n".join(bad)


def test_the_agent_imports_nothing_of_the_ui_anywhere():
    bad = [f"{p.relative_to(ROOT)}:{line} imports {name}"
           for p in files(AGENT) for line, name in imports(p, module_level_only=False)
           if hits(name, AGENT_FORBIDDEN)]
    assert not bad, "\n".join(bad)


def test_the_static_check_can_fail(tmp_path):
    """The checker itself sees the imports it is meant to forbid (else the tests above pass
    vacuously)."""
    f = tmp_path / "probe.py"
    f.write_text("import os\nfrom textual.app import App\nfrom ..tui import x\n"
                 "def f():\n    import torch\n")
    top = [n for _, n in imports(f, True, module="gpumon.agent.probe")]
    every = [n for _, n in imports(f, False, module="gpumon.agent.probe")]
    assert [n for n in top if hits(n, PURE_FORBIDDEN)] == ["textual.app", "textual.app.App"]
    assert "gpumon.tui" in top and "torch" not in top and "torch" in every


PROBE = r"""
import importlib, json, pkgutil, sys
import gpumon
mods = []
for root in sys.argv[1].split(","):
    m = importlib.import_module(root)
    mods.append(root)
    if hasattr(m, "__path__"):
        for info in pkgutil.walk_packages(m.__path__, root + "."):
            importlib.import_module(info.name)
            mods.append(info.name)
print(json.dumps({"imported": mods, "loaded": sorted(sys.modules)}))
"""


def fresh_import(roots):
    r = subprocess.run([sys.executable, "-c", PROBE, ",".join(roots)], capture_output=True,
                       text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout)


def test_pure_layers_load_neither_textual_nor_torch_in_a_fresh_interpreter():
    out = fresh_import(["gpumon.model", "gpumon.snapshot", "gpumon.estimate", "gpumon.protocol"])
    assert len(out["imported"]) > 10
    assert [m for m in out["loaded"] if hits(m, PURE_FORBIDDEN)] == []


def test_the_agent_loads_nothing_of_the_ui_nor_torch_in_a_fresh_interpreter():
    out = fresh_import(["gpumon.agent", "gpumon.client", "gpumon.protocol"])
    assert "gpumon.agent.core" in out["imported"]
    assert [m for m in out["loaded"] if hits(m, AGENT_FORBIDDEN + ("torch",))] == []


def test_import_linter_contracts_are_kept():
    exe = shutil.which("lint-imports")
    if exe is None:
        pytest.skip("import-linter is not installed (pip install import-linter)")
    r = subprocess.run([exe, "--no-cache"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-1000:]
    assert "0 broken" in r.stdout
