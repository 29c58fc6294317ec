"""What a checkpoint root holds, for ``obsckpt status`` and ``obsckpt verify``.

Reads a root (its iteration files, step directories and manifests) and says,
step by step, what is committed, what is not and why, and whether a step's
files still match its manifest; then renders that as text or JSON-ready dicts.
Argument parsing and exit codes are the command line's (:mod:`obsckpt.cli`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from pathlib import Path

from obsckpt.errors import (
    CliError,
    IterationContentError,
    IterationFileError,
    UnsupportedStoreError,
)
from obsckpt.store import layout, reader, repair, rootlock
from obsckpt.store.uri import local_root


def open_root(
    path: str, *, markers: Iterable[str] = (), repairing: bool = False
) -> tuple[Path, dict[str, int | None]]:
    """The root and its committed steps; CliError when it cannot be used.

    Args:
        path: the root, as the user gave it (errors name it so).
        markers: file names that make a directory a root before its first save
            (the demo's marker): it then has no iteration file and no step yet.
        repairing: an iteration file that holds no step number (empty, text) is
            what ``obsckpt repair`` mends: its kind's step is None, not an error.
    """
    try:
        root = Path(local_root(path, "DIR"))
    except (UnsupportedStoreError, ValueError) as exc:
        raise CliError(str(exc)) from None
    if not root.exists():
        raise CliError(f"{path}: no such directory")
    if not root.is_dir():
        raise CliError(f"{path}: not a directory")
    if not os.access(root, os.R_OK | os.X_OK):
        raise CliError(f"{path}: permission denied")
    latest: dict[str, int | None] = {}
    for kind in layout.KINDS:
        try:
            latest[kind] = reader.read_iteration(root, kind)
        except IterationContentError as exc:
            if not repairing:
                raise CliError(str(exc)) from None
            latest[kind] = None
        except IterationFileError as exc:
            raise CliError(str(exc)) from None
    if (
        not any((root / name).is_file() for name in layout.ITERATION_FILES.values())
        and not reader.steps_on_disk(root)
        # The demo's root before its first save: a root all the same (it says to run status).
        and not any((root / name).is_file() for name in markers)
    ):
        raise CliError(
            f"{path}: not a checkpoint root (no {layout.ITERATION_FILES['checkpoint']}, "
            f"no {layout.ITERATION_FILES['state_dict']} and no "
            f"{layout.STEP_DIR_PREFIX}<N> directories)"
        )
    return root, latest


def _is_temp_path(rel: str) -> bool:
    """Whether a step's file ``rel`` is a temp file, or lies in a scratch directory."""
    return any(layout.is_temp_name(part) for part in rel.split(os.sep))


def describe_step(
    root: Path,
    step: int,
    latest: dict[str, int | None],
    now: float,
    first_manifest: int | None = None,
) -> dict:
    """What is known of one step directory: committed or not (and why), size, age.

    ``first_manifest`` is the oldest step of the root with a manifest (None:
    none has one). A step without one below it, and below the latest commit,
    was written before obsckpt committed here (verl's own checkpointing, say):
    obsckpt cannot tell whether it is whole, so it is ``foreign``, not failed.
    """
    sdir = layout.step_dir(root, step)
    files = reader.step_files(sdir)
    temps = [f for f, _s, _m in files if _is_temp_path(f)]
    data = [f for f in files if not _is_temp_path(f[0]) and f[0] != layout.MANIFEST_NAME]
    nbytes = sum(s for _f, s, _m in files)
    mtime = max((m for _f, _s, m in files), default=sdir.stat().st_mtime)
    has_manifest = (sdir / layout.MANIFEST_NAME).is_file()
    names = {os.path.basename(f) for f, _s, _m in data}
    full = any(n.startswith(layout.FULL_CHECKPOINT_PREFIXES) for n in names)
    ck, sd = latest.get("checkpoint"), latest.get("state_dict")
    newest = max((s for s in (ck, sd) if s is not None), default=None)
    note = ""
    # Sizes against the manifest (no checksums: a root holds hundreds of gigabytes).
    damage = repair.step_problem(root, step) if has_manifest else None
    if has_manifest and not data and step not in (ck, sd):
        # obsckpt's retention removes a step's whole directory: a manifest left alone
        # means something else removed the files.
        state, kind = "damaged", "-"
        note = (
            "committed once; every file it listed is gone (not obsckpt's retention, which "
            "removes the whole directory): see `obsckpt verify`"
        )
    elif damage is not None:
        # Committed once (or its commit was cut short): its files no longer match.
        state = "damaged"
        kind = "checkpoint" if full or step == ck else "state_dict"
        note = f"its files no longer match its manifest ({damage}): see `obsckpt verify`"
    elif step in (ck, sd) or (has_manifest and newest is not None and step < newest):
        # A manifest alone does not make a step committed: a commit interrupted after
        # writing it (the iteration file's write failed, the monitor died) leaves one.
        state = "committed"
        if step == ck:
            note = "latest checkpoint"
        elif step == sd:
            note = "latest state dict"
        if not has_manifest:
            note = (note + "; " if note else "") + "no manifest (not written by obsckpt)"
        kind = "checkpoint" if full or step == ck else "state_dict"
    elif (
        not has_manifest
        and newest is not None
        and step < newest
        and (first_manifest is None or step < first_manifest)
    ):
        state = "foreign"
        kind = "checkpoint" if full else "-"
        note = (
            "no manifest: written before obsckpt committed in this root (by verl's own "
            "checkpointing, say), or by a save that failed; whether it is whole cannot be told"
        )
    else:
        state = "uncommitted"
        kind = "checkpoint" if full else "state_dict"
        if has_manifest:
            note = (
                "never committed: its manifest was written but its commit did not finish "
                "(no iteration file names it)"
            )
        elif newest is None or step > newest:
            note = "never committed: still being written, or abandoned by an interrupted save"
        else:
            note = "never committed: a save failed or the job stopped before it was whole"
        if temps:
            note += f"; {len(temps)} partly written temp file(s)"
    return {
        "step": step,
        "state": state,
        "kind": kind,
        "files": len(data),
        "temp_files": len(temps),
        "bytes": nbytes,
        "mtime": mtime,
        "age_s": max(0.0, now - mtime),
        "manifest": has_manifest,
        "note": note,
    }


def first_manifest_step(root: Path, steps: list[int]) -> int | None:
    """The oldest of ``steps`` whose directory holds a manifest (None: none does)."""
    return next(
        (s for s in steps if (layout.step_dir(root, s) / layout.MANIFEST_NAME).is_file()), None
    )


def root_status(root: Path, latest: dict[str, int | None]) -> dict:
    """The root's committed, uncommitted and foreign steps, its monitor and its problems."""
    now = time.time()
    on_disk = reader.steps_on_disk(root)
    first = first_manifest_step(root, on_disk)
    steps = [describe_step(root, s, latest, now, first) for s in on_disk]
    problems = []
    on_disk = {s["step"] for s in steps}
    for kind, step in latest.items():
        if step is not None and step not in on_disk:
            problems.append(
                f"{layout.ITERATION_FILES[kind]} names step {step}, which is not on disk"
            )
    by_step = {s["step"]: s for s in steps}
    for bad in repair.check_iterations(root):
        if bad.named not in by_step:
            continue  # not on disk: said above
        described = by_step[bad.named]
        if described["state"] == "committed":
            described["state"] = "not whole"
            described["note"] = f"named by {bad.path.name}, but not whole: {bad.problem}"
        problems.append(f"{bad.describe()}. {_repair_hint(root, bad)}")
    problems += [
        f"step {s['step']} is damaged: {s['note']}" for s in steps if s["state"] == "damaged"
    ]
    return {
        "root": str(root.resolve()),
        "latest": latest,
        "committed": [s["step"] for s in steps if s["state"] == "committed"],
        "uncommitted": [s["step"] for s in steps if s["state"] == "uncommitted"],
        "foreign": [s["step"] for s in steps if s["state"] == "foreign"],
        # The monitor committing into this root now (its lock's details), or None.
        "monitor": rootlock.locked_by(root),
        "steps": steps,
        "problems": problems,
    }


def _repair_hint(root: Path, bad: repair.BadIteration) -> str:
    if bad.latest_whole is None:
        return (
            f"`obsckpt repair {root}` moves the file aside (no step on disk is whole); "
            "a resume then starts afresh"
        )
    return f"`obsckpt repair {root}` points it at step {bad.latest_whole} (it deletes nothing)"


def format_status(st: dict) -> str:
    """``obsckpt status``'s text: the latest steps, the monitor, a table of the steps."""
    latest = st["latest"]
    lines = [
        f"root: {st['root']}",
        f"latest checkpoint: {_opt(latest['checkpoint'])}    "
        f"latest state dict: {_opt(latest['state_dict'])}",
        "monitor: "
        + (
            "none holds this root (no job is committing into it)"
            if st["monitor"] is None
            else f"running ({rootlock.describe_holder(st['monitor'])})"
        ),
    ]
    if st["steps"]:
        header = ("step", "state", "kind", "files", "size", "age", "")
        rows = [header] + [
            (
                str(s["step"]),
                s["state"],
                s["kind"],
                str(s["files"]),
                format_size(s["bytes"]),
                _age(s["age_s"]),
                s["note"],
            )
            for s in st["steps"]
        ]
        widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
        right = {0, 3, 4}
        for r in rows:
            cells = [
                c.rjust(widths[i]) if i in right else c.ljust(widths[i]) for i, c in enumerate(r)
            ]
            lines.append("  ".join(cells).rstrip())
    else:
        lines.append("no step directories")
    for p in st["problems"]:
        lines.append(f"problem: {p}")
    return "\n".join(lines)


def format_size(n: float) -> str:
    """``512 B``, ``1.5 KiB``, ... ``2.0 TiB``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _age(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f}s ago"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m ago"
    if seconds < 172800:
        return f"{seconds / 3600:.0f}h ago"
    return f"{seconds / 86400:.0f}d ago"


def _opt(v) -> str:
    return "none" if v is None else str(v)


def verify_one(
    root: Path, step: int, latest: dict[str, int | None], missing: dict[int, list[str]]
) -> dict:
    """One step checked against its manifest: ok, failed (with its problems) or skipped.

    ``missing`` maps the steps an iteration file names but that are not on disk
    to those files' names. A step whose files are all gone fails like any other:
    obsckpt's retention removes whole step directories, so it is not among them.
    """
    sdir = layout.step_dir(root, step)
    result = {"step": step, "result": "ok", "on_disk": True, "files": 0, "bytes": 0, "problems": []}
    if step in missing:
        files = missing[step]
        verb = "names" if len(files) == 1 else "name"
        problem = f"{sdir} is missing, but {' and '.join(files)} {verb} it"
        return dict(result, result="failed", on_disk=False, problems=[problem])
    problems = reader.verify_step(sdir)
    if problems:
        if (
            not (sdir / layout.MANIFEST_NAME).exists()
            and first_manifest_step(root, reader.steps_on_disk(root)) is None
        ):
            # Not a failure of the step: nothing says what it should hold.
            problems = [
                f"{sdir / layout.MANIFEST_NAME}: missing manifest; no step of this root has one, "
                "so it was not committed by obsckpt (verl's own checkpointing, say) and there is "
                "nothing to check its files against. Steps obsckpt commits here can be verified"
            ]
            return dict(result, result="unverifiable", problems=problems)
        return dict(result, result="failed", problems=list(problems))
    records = reader.read_manifest(sdir)
    return dict(result, files=len(records), bytes=sum(r.size for r in records))


def verify_root(
    root: Path,
    latest: dict[str, int | None],
    *,
    step: int | None = None,
    every: bool = False,
    shown: str | None = None,
) -> list[dict]:
    """Check steps against their manifests: the latest committed, ``step``, or ``every`` one.

    Every mode also checks that the steps the iteration files name are on disk:
    a reader resuming from a missing step fails however whole the others are.

    Args:
        root: the checkpoint root (from :func:`open_root`).
        latest: the steps its iteration files name.
        step: the step to check (None: the latest committed).
        every: check every step that has a manifest.
        shown: the root as the user gave it, for errors (default ``root``).

    Returns:
        One result per step (:func:`verify_one`), in step order.

    Raises:
        CliError: there is nothing to verify, or ``step`` is not on disk.
    """
    shown = str(root) if shown is None else shown
    named: dict[int, list[str]] = {}
    for kind, named_step in latest.items():
        if named_step is not None:
            named.setdefault(named_step, []).append(layout.ITERATION_FILES[kind])
    missing = {s: files for s, files in named.items() if not layout.step_dir(root, s).is_dir()}
    if every:
        steps = [
            s
            for s in reader.steps_on_disk(root)
            if (layout.step_dir(root, s) / layout.MANIFEST_NAME).is_file() or s in named
        ]
        if not steps and not missing:
            raise CliError(f"{shown}: no step with a manifest to verify")
    elif step is not None:
        if step not in missing and not layout.step_dir(root, step).is_dir():
            raise CliError(f"{shown}: step {step} is not on disk ({layout.step_dir_name(step)})")
        steps = [step]
    else:
        newest = latest["checkpoint"] if latest["checkpoint"] is not None else latest["state_dict"]
        if newest is None:
            raise CliError(f"{shown}: no committed step to verify (no iteration file); pass --step")
        steps = [newest]
    return [verify_one(root, s, latest, missing) for s in sorted(set(steps) | set(missing))]


def verify_report(root: Path, results: list[dict]) -> dict:
    """``obsckpt verify --json``'s document: the root, whether every step passed, the steps."""
    ok = all(r["result"] == "ok" for r in results)
    return {"root": str(root.resolve()), "ok": ok, "steps": results}


def verify_lines(result: dict) -> tuple[list[str], str]:
    """One step's text: its problems (for stderr) and its result line (for stdout)."""
    step = result["step"]
    problems = [f"step {step}: {p}" for p in result["problems"]]
    if result["result"] == "ok":
        line = (
            f"step {step}: OK, {result['files']} files, "
            f"{format_size(result['bytes'])} match the manifest"
        )
    elif result["result"] == "unverifiable":
        line = f"step {step}: NOT VERIFIABLE, not written by obsckpt (no manifest)"
    elif result["on_disk"]:
        line = f"step {step}: FAILED, {len(result['problems'])} problem(s)"
    else:
        line = f"step {step}: FAILED, not on disk"
    return problems, line
