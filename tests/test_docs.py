"""The README and docs/ as a reader meets them: every code block is either a whole program that runs as printed
(marked ``<!-- program: NAME -->`` on the line before it; run here) or marked ``<!-- fragment -->`` (shell commands,
part of a loop: read, not run), and every relative link leads to a file and a heading that exist.

A block without a language (a fence alone: a text figure, such as the layer diagrams of docs/architecture.md) is no
code and needs no mark.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from support import PYTHON, REPO
from support.environment import clean_env

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FRAGMENT = "<!-- fragment -->"
_PROGRAM = re.compile(r"^<!-- program: ([\w.-]+\.py) -->$")
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


@dataclass
class Block:
    page: Path
    line: int  # of the opening fence, from 1
    language: str
    mark: str  # the line before the fence ("" when it is no mark)
    text: str

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"

    @property
    def program(self) -> str | None:
        match = _PROGRAM.match(self.mark)
        return match.group(1) if match else None


def blocks(page: Path) -> list[Block]:
    lines = page.read_text().splitlines()
    found, start = [], None
    for number, line in enumerate(lines):
        if not line.startswith("```"):
            continue
        if start is None:
            start = number
            continue
        before = next((text.strip() for text in reversed(lines[:start]) if text.strip()), "")
        mark = before if before.startswith("<!--") else ""
        found.append(Block(page, start + 1, lines[start][3:].strip(), mark, "\n".join(lines[start + 1 : number]) + "\n"))
        start = None
    assert start is None, f"{page.relative_to(REPO)}:{start + 1 if start is not None else 0}: a code block is never closed"
    return found


def programs() -> dict[str, Block]:
    found: dict[str, Block] = {}
    for page in PAGES:
        for block in blocks(page):
            if block.program:
                assert block.program not in found, f"{block.where}: a second program named {block.program} ({found[block.program].where})"
                found[block.program] = block
    return found


def test_every_code_block_is_a_program_that_runs_or_marked_a_fragment() -> None:
    unmarked = [
        f"{block.where} ({block.language})"
        for page in PAGES
        for block in blocks(page)
        if block.language and block.mark != FRAGMENT and not block.program
    ]
    assert unmarked == [], (
        "code blocks neither run by tests/test_docs.py nor marked as a fragment: put '<!-- program: NAME.py -->' (a whole"
        f" program, run as printed) or '{FRAGMENT}' on the line before each: {unmarked}"
    )
    assert "quickstart.py" in programs()


def test_every_mark_stands_right_before_a_code_block() -> None:
    stray = []
    for page in PAGES:
        lines = page.read_text().splitlines()
        for number, line in enumerate(lines):
            if line.strip() == FRAGMENT or _PROGRAM.match(line.strip()):
                after = next((text for text in lines[number + 1 :] if text.strip()), "")
                if not after.startswith("```"):
                    stray.append(f"{page.relative_to(REPO)}:{number + 1}")
    assert stray == [], f"marks with no code block after them: {stray}"


def anchors(page: Path) -> set[str]:
    """The anchors GitHub gives the headings of ``page``: lower case, punctuation dropped, spaces made hyphens, a
    repeated one numbered."""
    seen: dict[str, int] = {}
    found = set()
    inside = False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            inside = not inside
        if inside or not re.match(r"^#{1,6} ", line):
            continue
        slug = re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def test_every_relative_link_leads_to_a_file_and_heading_that_exist() -> None:
    broken = []
    for page in PAGES:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.DOTALL)
        for target in _LINK.findall(text):
            if re.match(r"^[a-z]+:", target):
                continue  # http(s), mailto: not ours to check
            path, _, anchor = target.partition("#")
            goal = (page.parent / path).resolve() if path else page
            if not goal.exists():
                broken.append(f"{page.relative_to(REPO)}: {target} (no such file)")
            elif anchor and goal.suffix == ".md" and anchor not in anchors(goal):
                broken.append(f"{page.relative_to(REPO)}: {target} (no such heading)")
    assert broken == [], broken


def run_program(block: Block, folder: Path, text: str | None = None, timeout: float = 150) -> subprocess.CompletedProcess:
    """``python NAME`` in ``folder``, as a reader runs the block saved under its name (or ``text`` in its place)."""
    script = folder / str(block.program)
    script.write_text(block.text if text is None else text)
    result = subprocess.run([PYTHON, script.name], cwd=folder, env=clean_env(), capture_output=True, text=True,
                            timeout=timeout, stdin=subprocess.DEVNULL)
    assert result.returncode == 0, f"{block.where}: {script.name} exited with {result.returncode}\n{result.stdout}\n{result.stderr}"
    return result


@pytest.mark.procs
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", sorted(set(programs()) - {"quickstart.py"}))
def test_a_program_of_the_docs_runs_as_printed_and_again_from_its_checkpoint(name: str, tmp_path: Path) -> None:
    block = programs()[name]
    run_program(block, tmp_path)
    run_program(block, tmp_path)  # the docs' programs resume from what the first run left


def epochs(output: str) -> list[int]:
    return [int(number) for number in re.findall(r"^epoch (\d+): loss \S+$", output, re.MULTILINE)]


@pytest.mark.procs
@pytest.mark.timeout(400)
def test_the_readme_quick_start_runs_as_printed_and_resumes_exactly(tmp_path: Path) -> None:
    """The Quick start, taken from README.md: ``python quickstart.py`` (two CPU ranks) runs, and run again goes on from
    its checkpoint; the two runs end with the weights, optimizer state and loader position of one run twice as long."""
    block = programs()["quickstart.py"]
    (tmp_path / "twice").mkdir()
    first = run_program(block, tmp_path / "twice")
    assert epochs(first.stdout) == [0, 1, 2], first.stdout
    second = run_program(block, tmp_path / "twice")
    assert epochs(second.stdout) == [3, 4, 5], second.stdout

    longer = block.text.replace('range(state["epoch"], state["epoch"] + 3)', 'range(state["epoch"], state["epoch"] + 6)')
    assert longer != block.text, "the Quick start's loop is no longer `range(state['epoch'], state['epoch'] + 3)`: update this test"
    (tmp_path / "once").mkdir()
    once = run_program(block, tmp_path / "once", text=longer)
    assert epochs(once.stdout) == [0, 1, 2, 3, 4, 5], once.stdout
    assert once.stdout.splitlines()[-3:] == second.stdout.splitlines()[-3:]  # the same losses, digit for digit

    resumed, straight = (torch.load(folder / "quickstart.ckpt", weights_only=True) for folder in (tmp_path / "twice", tmp_path / "once"))
    assert set(resumed) == {"model", "optimizer", "loader", "epoch"} and resumed["epoch"] == straight["epoch"] == 6
    for name, value in straight["model"].items():
        assert torch.equal(resumed["model"][name], value), name
    for rank in (0, 1):  # where each rank is in the data, and its random generators
        saved, reference = resumed["loader"]["per_rank"][rank], straight["loader"]["per_rank"][rank]
        assert (saved["epoch"], saved["batches_consumed"]) == (reference["epoch"], reference["batches_consumed"])
        assert torch.equal(saved["random_state"]["torch"], reference["random_state"]["torch"])
