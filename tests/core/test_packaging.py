"""What a packager checks (issue 32 item 11): the LICENSE the metadata names exists and is MIT,
the license is an SPDX string (a table is deprecated), every package-data file exists, and
the sdist carries every file README.md links to."""
import re
import subprocess
import sys
import tarfile
import pytest

tomllib = pytest.importorskip("tomllib")  # 3.11+

from .test_docs_links import LINK, ROOT


def _project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_license_is_an_spdx_string_with_its_file():
    p = _project()["project"]
    assert p["license"] == "MIT"  # not {text = "MIT"}: deprecated, 4 warnings per build
    for f in p["license-files"]:
        assert (ROOT / f).read_text().startswith("MIT License")


def test_every_package_data_file_exists():
    data = _project()["tool"]["setuptools"]["package-data"]
    for pkg, patterns in data.items():
        for pat in patterns:
            assert list((ROOT / pkg.replace(".", "/")).glob(pat)), f"{pkg}: {pat}"


def test_the_test_extra_brings_the_setuptools_the_build_needs():
    """The sdist and wheel tests build without isolation, with the test environment's setuptools:
    the test extra asks for the build-system's floor itself (torch 2.13 happened to pull it; with
    torch 2.11 a fresh venv kept setuptools 65.5 and both tests failed)."""
    p = _project()
    (build,) = [r for r in p["build-system"]["requires"] if r.startswith("setuptools")]
    assert build in p["project"]["optional-dependencies"]["test"]


def test_the_sdist_has_every_file_the_readme_links(tmp_path):
    subprocess.run([sys.executable, "setup.py", "-q", "sdist", "-d", str(tmp_path)], cwd=ROOT,
                   check=True, capture_output=True)
    (sdist,) = tmp_path.glob("*.tar.gz")
    with tarfile.open(sdist) as t:
        names = {n.split("/", 1)[1] for n in t.getnames() if "/" in n}
    links = [x.partition("#")[0] for x in LINK.findall((ROOT / "README.md").read_text())
             if not re.match(r"[a-z]+:", x) and not x.startswith("#")]
    assert len(links) > 15
    missing = [x for x in links if x not in names]
    assert not missing, missing
    assert "LICENSE" in names


def test_the_test_command_installs_what_the_readmes_framework_claims_need():
    """Issue 32 item 10: the README's test command skipped the tests behind its Hugging Face,
    Lightning and per-architecture claims (the test extra had neither library)."""
    extras = _project()["project"]["optional-dependencies"]
    names = {re.split(r"[<>=\[ ]", d)[0] for d in extras["frameworks"]}
    assert {"transformers", "accelerate", "lightning"} <= names
    script = (ROOT / "scripts" / "test.sh").read_text()
    assert '-e ".[test,frameworks]"' in script
    for test in ("tests/phases/test_frameworks.py", "tests/estimate/test_architectures.py"):
        assert (ROOT / test).exists()
