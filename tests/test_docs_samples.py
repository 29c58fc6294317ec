"""The figures and sample outputs the docs show agree with what the program measures
and prints: docs/performance.md's results table with benchmarks/results.json (the run
it reports), and the helpers that compare docs/demo.md's samples with a real run
(used by tests/test_demo.py's end-to-end run)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from docs_samples import DOCS, missing_shapes, shape

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results.json"
_ROW = re.compile(r"^\| (\w+) \| ([-\d.]+) \| ([^|]+) \| ([^|]+) \|")


def results_table() -> dict[str, tuple[str, str, str]]:
    """The rows of performance.md's "Results (full run, this machine)" table."""
    text = (DOCS / "performance.md").read_text(encoding="utf-8")
    section = text.split("## Results (full run, this machine)", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        m = _ROW.match(line)
        if m:
            rows[m.group(1)] = (m.group(2), m.group(3).strip(), m.group(4).strip())
    return rows


def test_the_results_table_is_results_json():
    results = json.loads(RESULTS.read_text())["results"]
    rows = results_table()
    measured = {k for k, r in results.items() if isinstance(r.get("value"), (int, float))}
    assert set(rows) == measured, "rows and results.json's measured results differ"
    for name, (value, target, met) in rows.items():
        r = results[name]
        decimals = len(value.partition(".")[2])
        assert value == f"{r['value']:.{decimals}f}", (name, value, r["value"])
        assert target == r["target"], (name, target, r["target"])
        assert met == ("yes" if r["met"] else "**no**"), (name, met, r["met"])


def test_shape_keeps_words_and_drops_figures():
    a = "save optim                         4  37.5 ms  48.8 ms   <= 50.0 ms  36.3 ms  6.9 MiB"
    b = "save optim     16  3.1 ms  9.8 ms   <= 10.0 ms  2.0 ms  1,024.0 MiB"
    assert shape(a) == shape(b)
    assert shape("[####....] step 1/6  loss 6.279") == shape("[#.......] step 3/4  loss 5.1")
    assert shape("checkpoints: /tmp/a/ckpt  (x)") == shape("checkpoints: /tmp/b  (x)")
    assert missing_shapes(["save optim  4  1 ms"], "save model  4  1 ms") == ["save optim  4  1 ms"]


def test_shape_takes_a_unit_as_part_of_its_figure():
    """The summary scales a figure's unit with it (96.2 ms, 1.05 s; 9.8 MiB, 1.0 GiB), so a
    run slower or bigger than the docs' sample has the sample's shape; a different word
    or a figure without its unit does not."""
    sample = "rollout pause (broadcast)  6  62.5 ms  96.2 ms  <= 100.0 ms  55.5 ms  9.8 MiB sent"
    slow = "rollout pause (broadcast)  6  0.95 s  1.20 s  <= 2.50 s  812.4 ms  1.0 GiB sent"
    assert shape(sample) == shape(slow)
    assert shape("broadcast  35.4 MiB/s") == shape("broadcast  812.0 KiB/s")
    assert shape("ranks ready in 6.2 s") == shape("ranks ready in 950.0 ms")
    assert shape("rollout pause  62.5 ms") != shape("rollout pause  62.5")
    assert shape("9.8 MiB sent") != shape("9.8 MiB written")
    assert shape("(12/30s)") == shape("(3/30s)") != shape("(3/30 s)")
