"""The sample outputs the docs show, as shapes a real run's output must have.

A sample's numbers (timings, sizes, addresses, steps) differ from run to run, and
so do the units the program picks for them (a pause of 1.2 s prints in seconds,
one of 96 ms in milliseconds); its shape (the rows, the words, the columns) must
not drift from what the program prints. :func:`shape` keeps the shape of a line; the tests compare the docs'
samples with a real run's lines through it.
"""

from __future__ import annotations

import re
from pathlib import Path

DOCS = Path(__file__).resolve().parents[1] / "docs"

_NUMBER = re.compile(r"\d+(?:[.,]\d+)*")
_BAR = re.compile(r"\[[#.]+\]")
_PATH = re.compile(r"(?:/[\w.@+-]+)+/?")
_RULE = re.compile(r"-{5,}")  # a table's rule, as wide as its columns
# A figure's unit, which the program scales with the figure (see obsckpt.demo.summary).
_DURATION = re.compile(r"\b\d+(?:[.,]\d+)* (?:µs|ms|s)\b")
_SIZE = re.compile(r"\b\d+(?:[.,]\d+)* (?:B|KiB|MiB|GiB|TiB)(/s)?\b")


def shape(line: str) -> str:
    """``line`` with its numbers (and their units), progress bar, rules, paths and
    spacing made uniform."""
    line = _BAR.sub("[bar]", line)
    line = _RULE.sub("-----", line)
    line = _DURATION.sub("N <time>", line)
    line = _SIZE.sub(lambda m: "N <size>" + (m.group(1) or ""), line)
    line = _PATH.sub("PATH", line)
    line = _NUMBER.sub("N", line)
    return " ".join(line.split())


def code_blocks(doc: str) -> list[list[str]]:
    """The fenced code blocks of ``docs/<doc>``, each as its lines."""
    blocks, current = [], None
    for line in (DOCS / doc).read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            if current is None:
                current = []
            else:
                blocks.append(current)
                current = None
        elif current is not None:
            current.append(line)
    return blocks


def block_with(doc: str, first: str) -> list[str]:
    """The code block of ``doc`` whose first line starts with ``first`` (spacing aside)."""
    found = [b for b in code_blocks(doc) if b and b[0].strip().startswith(first)]
    assert len(found) == 1, f"docs/{doc}: {len(found)} code blocks start with {first!r}"
    return found[0]


def missing_shapes(sample: list[str], output: str) -> list[str]:
    """The sample's lines whose shape no line of ``output`` has."""
    have = {shape(line) for line in output.splitlines()}
    return [line for line in sample if line.strip() and shape(line) not in have]
