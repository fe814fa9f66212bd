"""Every relative link in README.md and docs/*.md names a file that exists (a manual merged or
moved must not leave a dead link behind), and its #anchor, if any, a heading of that file."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to dashes."""
    h = heading.strip().lower()
    h = re.sub(r"[^\w\- ]", "", h)
    return h.replace(" ", "-")


def _links():
    for md in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in LINK.findall(md.read_text()):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            yield md, target


def test_every_relative_link_in_the_manual_resolves():
    dead = []
    n = 0
    for md, target in _links():
        n += 1
        path, _, anchor = target.partition("#")
        f = (md.parent / path).resolve()
        if not f.exists():
            dead.append(f"{md.relative_to(ROOT)}: {target}")
        elif anchor and f.suffix == ".md":
            heads = {_anchor(h) for h in re.findall(r"^#+ (.*)$", f.read_text(), re.M)}
            if anchor not in heads:
                dead.append(f"{md.relative_to(ROOT)}: {target} (no such heading)")
    assert n > 20  # the manual's table alone has more: the pattern found the links
    assert not dead, dead


def test_agent_and_attach_are_one_manual():
    agent = (ROOT / "docs" / "agent.md").read_text()
    for heading in ("## Starting the agent", "## What gpumon says about the process you named",
                    "### How a process ended", "## `gpumon ls`", "## `gpumon attach PID`",
                    "## `gpumon demo`", "## How it works", "## What it costs", "## Limits"):
        assert agent.count(heading + "\n") == 1, heading
    # attach.md only points there (old links keep working), it repeats nothing
    attach = (ROOT / "docs" / "attach.md").read_text()
    assert "agent.md" in attach and len(attach.splitlines()) < 10
