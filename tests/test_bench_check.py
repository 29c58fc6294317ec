"""The regression guard's verdicts (benchmarks/check.py): off target, or more than 15%
worse than the reference, in either direction of a target; rows of one tree only."""

from __future__ import annotations

from benchmarks.check import compare


def _row(value, target):
    return {"value": value, "target": target}


def test_marks_off_target_and_regressions() -> None:
    head = [{"a": _row(0.9, ">= 0.8"), "b": _row(1.3, "<= 1.15"), "c": _row(0.5, ">= 0.2")}]
    ref = [{"a": _row(0.95, ">= 0.8"), "b": _row(1.0, "<= 1.15"), "c": _row(1.0, ">= 0.2")}]
    lines, marked = compare(head, ref)
    text = "\n".join(lines)
    assert marked
    row = {line.split()[0]: line for line in lines[1:]}
    assert "mark" not in row["a"] and row["a"].rstrip().endswith(">= 0.8")  # 5% worse: fine
    assert "off target" in row["b"] and "30% worse" in row["b"]
    assert "50% worse" in row["c"] and "off target" not in row["c"]
    assert text.count("\n") == 3


def test_medians_and_rows_of_one_tree() -> None:
    head = [{"a": _row(1.0, "<= 1.15"), "new": _row(0.1, "<= 1")}, {"a": _row(1.1, "<= 1.15")}]
    ref = [{"a": _row(1.0, "<= 1.15")}, {"a": _row(1.02, "<= 1.15")}]
    lines, marked = compare(head, ref)
    assert not marked
    row = {line.split()[0]: line for line in lines[1:]}
    assert "1.05" in row["a"] and "1.01" in row["a"]
    assert "—" in row["new"]
