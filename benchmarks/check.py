#!/usr/bin/env python
"""The regression guard: this tree's quick benchmarks against a reference commit's.

    python benchmarks/check.py --ref <commit> [--rounds 2] [--only save,load]

The reference is checked out in a temporary git worktree and both trees' quick runs
(``benchmarks/run.py --quick``) alternate, round by round, in this one session on this
one machine: a comparison with figures from another machine proves nothing. Each
row's value is the median over the rounds. A row is marked when it is off its target,
or more than 15% worse than the reference's (for a ``>=`` row: below 0.85 times the
reference; for a ``<=`` row: above 1.15 times it). Rows one tree has and the other
does not are listed, unmarked. Exit status 1 when any row is marked.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORSE = 0.15


def _run(tree: str, out: str, only: str | None) -> dict:
    cmd = [sys.executable, os.path.join(tree, "benchmarks", "run.py"), "--quick", "--json", out]
    if only:
        cmd += ["--only", only]
    # The tree's own obsckpt first on the path (run.py puts its root there too).
    env = dict(os.environ, PYTHONPATH=tree)
    done = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    if not os.path.exists(out):
        raise SystemExit(f"benchmarks of {tree} wrote no results:\n{done.stderr[-3000:]}")
    with open(out, encoding="utf-8") as f:
        return json.load(f)["results"]


def _only_known(tree: str, only: str | None) -> str | None:
    """``only`` less the benchmarks ``tree``'s run.py does not know (None: all of them)."""
    if only is None:
        return None
    text = open(os.path.join(tree, "benchmarks", "run.py"), encoding="utf-8").read()
    kept = [n for n in only.split(",") if f'"{n}"' in text]
    return ",".join(kept) or None


def compare(head: list[dict], ref: list[dict]) -> tuple[list[str], bool]:
    """The table's lines, and whether any row is marked."""
    names = sorted(set().union(*map(set, head + ref)))
    lines = [f"{'row':<34} {'this tree':>10} {'reference':>10} {'target':>9}  mark"]
    marked = False
    for name in names:
        values = [r[name]["value"] for r in head if name in r and r[name]["value"] is not None]
        refs = [r[name]["value"] for r in ref if name in r and r[name]["value"] is not None]
        spec = next((r[name] for r in head + ref if name in r), {})
        target = spec.get("target", "")
        now = statistics.median(values) if values else None
        before = statistics.median(refs) if refs else None
        marks = []
        if now is not None and target:
            op, bound = target.split()
            if (op == ">=" and now < float(bound)) or (op == "<=" and now > float(bound)):
                marks.append("off target")
            if before is not None and before > 0:
                if (op == ">=" and now < before * (1 - WORSE)) or (
                    op == "<=" and now > before * (1 + WORSE)
                ):
                    marks.append(f"{abs(now / before - 1):.0%} worse than the reference")
        marked |= bool(marks)
        fmt = lambda v: "—" if v is None else f"{v:.4g}"  # noqa: E731
        lines.append(f"{name:<34} {fmt(now):>10} {fmt(before):>10} {target:>9}  {'; '.join(marks)}")
    return lines, marked


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ref", required=True, help="the reference commit (e.g. the previous main)")
    p.add_argument("--rounds", type=int, default=2, help="alternating runs of each tree")
    p.add_argument("--only", default=None, help="benchmarks to run (run.py's --only)")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error(f"--rounds must be at least 1, got {args.rounds}")
    work = tempfile.mkdtemp(prefix="obsckpt-bench-check-")
    tree = os.path.join(work, "ref")
    subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", tree, args.ref], check=True)
    head: list[dict] = []
    ref: list[dict] = []
    try:
        for n in range(args.rounds):
            print(f"round {n + 1} of {args.rounds}: reference {args.ref}", file=sys.stderr)
            ref.append(
                _run(tree, os.path.join(work, f"ref-{n}.json"), _only_known(tree, args.only))
            )
            print(f"round {n + 1} of {args.rounds}: this tree", file=sys.stderr)
            head.append(_run(ROOT, os.path.join(work, f"head-{n}.json"), args.only))
    finally:
        subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", tree], check=False)
    lines, marked = compare(head, ref)
    print(f"quick benchmarks, this tree against {args.ref}, {args.rounds} round(s) each:")
    print("\n".join(lines))
    return 1 if marked else 0


if __name__ == "__main__":
    sys.exit(main())
