"""The ``obsckpt`` command: run the demo job, inspect and verify checkpoint directories.

::

    obsckpt demo [--steps N] [--save-every N] [--world-size N] [...]
    obsckpt status DIR [--json]
    obsckpt verify DIR [--step N | --all] [--json]

Exit codes: 0 success; 1 a check failed (``verify``), ``status`` reported a
problem (an iteration file naming a step that is not on disk), or the demo
failed; 2 bad usage, a directory that is missing, is not a checkpoint root, or
holds an unreadable iteration file, or (``demo``) the ``demo`` extra is not
installed; 128 + the signal's number when a signal stopped the demo (130
SIGINT, 143 SIGTERM, 129 SIGHUP).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TextIO

from obsckpt import commit, layout, reader, rootlock, validators
from obsckpt.errors import CliError, IterationFileError

# The marker file the demo writes into its checkpoint root (obsckpt.demo.root.MARKER).
DEMO_MARKER = "obsckpt-demo.json"
# The demo's seed range (kept here so `obsckpt --help` does not import torch).
MAX_SEED = 2**32 - 1

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130

# The environment variable that tells `obsckpt demo`'s driver process it is one,
# holding the id of the `obsckpt demo` process that started it (run_demo_detached).
DEMO_DRIVER_ENV = "OBSCKPT_DEMO_DRIVER"
# The signals `obsckpt demo` passes on to its driver.
DEMO_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# After SIGTERM or SIGHUP, how long the driver has to stop before it is killed
# (it takes a few seconds: a step, at most 10 s of saves in flight, the shutdown).
DEMO_KILL_AFTER_S = 30


# ----------------------------------------------------------------------
# Reading a checkpoint root
# ----------------------------------------------------------------------


def open_root(path: str) -> tuple[Path, dict[str, int | None]]:
    """The root and its committed steps; CliError when it cannot be used."""
    root = Path(path)
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
        except IterationFileError as exc:
            raise CliError(str(exc)) from None
    if (
        all(v is None for v in latest.values())
        and not reader.steps_on_disk(root)
        # The demo's root before its first save: a root all the same (it says to run status).
        and not (root / DEMO_MARKER).is_file()
    ):
        raise CliError(
            f"{path}: not a checkpoint root (no {layout.ITERATION_FILES['checkpoint']}, "
            f"no {layout.ITERATION_FILES['state_dict']} and no global_step_<N> directories)"
        )
    return root, latest


def _walk_files(sdir: Path) -> list[tuple[str, int, float]]:
    files = []
    for dirpath, _dirs, names in os.walk(sdir):
        for name in names:
            full = os.path.join(dirpath, name)
            try:
                st = os.stat(full)
            except OSError:
                continue
            files.append((os.path.relpath(full, sdir), st.st_size, st.st_mtime))
    return files


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
    files = _walk_files(sdir)
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
    if has_manifest and not data and step not in (ck, sd):
        state, kind = "removed", "-"
        note = "committed once; its files were removed (retention), the manifest is left"
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


def _size(n: float) -> str:
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


def format_status(st: dict) -> str:
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
                _size(s["bytes"]),
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


def _opt(v) -> str:
    return "none" if v is None else str(v)


# ----------------------------------------------------------------------
# Commands
# ----------------------------------------------------------------------


def cmd_status(args, out: TextIO) -> int:
    root, latest = open_root(args.dir)
    st = root_status(root, latest)
    if args.json:
        out.write(json.dumps(st, indent=2) + "\n")
    else:
        out.write(format_status(st) + "\n")
    return EXIT_FAILED if st["problems"] else EXIT_OK


def cmd_verify(args, out: TextIO, err: TextIO) -> int:
    root, latest = open_root(args.dir)
    # Every mode checks that the steps the iteration files name are on disk:
    # a reader resuming from a missing step fails however whole the others are.
    named: dict[int, list[str]] = {}
    for kind, step in latest.items():
        if step is not None:
            named.setdefault(step, []).append(layout.ITERATION_FILES[kind])
    missing = {s: files for s, files in named.items() if not layout.step_dir(root, s).is_dir()}
    if args.all:
        steps = [
            s
            for s in reader.steps_on_disk(root)
            if (layout.step_dir(root, s) / layout.MANIFEST_NAME).is_file() or s in named
        ]
        if not steps and not missing:
            raise CliError(f"{args.dir}: no step with a manifest to verify")
    elif args.step is not None:
        if args.step not in missing and not layout.step_dir(root, args.step).is_dir():
            raise CliError(f"{args.dir}: step {args.step} is not on disk (global_step_{args.step})")
        steps = [args.step]
    else:
        step = latest["checkpoint"] if latest["checkpoint"] is not None else latest["state_dict"]
        if step is None:
            raise CliError(
                f"{args.dir}: no committed step to verify (no iteration file); pass --step"
            )
        steps = [step]
    results = [
        _verify_one(root, step, latest, missing, args.all)
        for step in sorted(set(steps) | set(missing))
    ]
    if args.json:
        ok = all(r["result"] != "failed" for r in results)
        out.write(
            json.dumps({"root": str(root.resolve()), "ok": ok, "steps": results}, indent=2) + "\n"
        )
    else:
        for r in results:
            step = r["step"]
            for p in r["problems"]:
                err.write(f"step {step}: {p}\n")
            if r["result"] == "skipped":
                out.write(
                    f"step {step}: skipped, removed by retention (only its manifest is left)\n"
                )
            elif r["result"] == "ok":
                out.write(
                    f"step {step}: OK, {r['files']} files, {_size(r['bytes'])} match the manifest\n"
                )
            elif r["on_disk"]:
                out.write(f"step {step}: FAILED, {len(r['problems'])} problem(s)\n")
            else:
                out.write(f"step {step}: FAILED, not on disk\n")
    return EXIT_FAILED if any(r["result"] == "failed" for r in results) else EXIT_OK


def _verify_one(
    root: Path, step: int, latest: dict[str, int | None], missing: dict[int, list[str]], all_: bool
) -> dict:
    """One step checked against its manifest: ok, failed (with its problems) or skipped."""
    sdir = layout.step_dir(root, step)
    result = {"step": step, "result": "ok", "on_disk": True, "files": 0, "bytes": 0, "problems": []}
    if step in missing:
        files = missing[step]
        verb = "names" if len(files) == 1 else "name"
        problem = f"{sdir} is missing, but {' and '.join(files)} {verb} it"
        return dict(result, result="failed", on_disk=False, problems=[problem])
    if all_ and describe_step(root, step, latest, time.time())["state"] == "removed":
        # As status shows it: retention removed its files and left the manifest.
        return dict(result, result="skipped")
    problems = reader.verify_step(sdir)
    if problems:
        if (
            not (sdir / layout.MANIFEST_NAME).exists()
            and first_manifest_step(root, reader.steps_on_disk(root)) is None
        ):
            problems = [
                f"{sdir / layout.MANIFEST_NAME}: missing manifest; no step of this root has one, "
                "so it was not committed by obsckpt (verl's own checkpointing, say) and there is "
                "nothing to check its files against. Steps obsckpt commits here can be verified"
            ]
        return dict(result, result="failed", problems=list(problems))
    records = reader.read_manifest(sdir)
    return dict(result, files=len(records), bytes=sum(r.size for r in records))


# Top-level modules of the ``demo`` extra that the job's processes import.
DEMO_MODULES = ("verl", "transformers", "accelerate")


def missing_demo_modules() -> list[str]:
    """The demo's modules that cannot be found, without importing them (verl takes ~10 s)."""
    import importlib.util

    missing = []
    for name in DEMO_MODULES:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            missing.append(name)
    return missing


def cmd_demo(args, out: TextIO, err: TextIO) -> int:
    # Checked before Ray starts: without it the job dies in its first worker
    # with a remote traceback.
    missing = missing_demo_modules()
    if missing:
        raise CliError(
            f"the demo needs {', '.join(missing)}, which {'is' if len(missing) == 1 else 'are'} "
            "not installed; install the demo extra: pip install 'obsckpt[demo]'"
        )
    from obsckpt.demo import DemoConfig, run_demo
    from obsckpt.errors import DemoError

    try:
        cfg = DemoConfig(
            steps=args.steps,
            save_every=args.save_every,
            world_size=args.world_size,
            sync_method=args.sync_method,
            ckpt_dir=args.ckpt_dir,
            resume=args.resume,
            duration=args.duration,
            metrics_port=None if args.no_metrics else args.metrics_port,
            metrics_host=args.metrics_host,
            file_sd=args.file_sd,
            otlp_endpoint=args.otlp_endpoint,
            address=args.address,
            namespace=args.namespace,
            save_strategy=args.save_strategy,
            keep=args.keep,
            device=args.device,
            seed=args.seed,
            progress=not args.no_progress,
            verbose=args.verbose,
        )
    except ValueError as exc:
        raise CliError(str(exc)) from None
    # Checked before the run, not found out after it.
    result_json = check_result_json(args.result_json) if args.result_json else None
    try:
        result = run_demo(cfg, out=out, err=err)
    except DemoError as exc:
        raise CliError(str(exc)) from None
    err.write(finish_line(result) + "\n")
    if result_json is not None:
        try:
            write_result_json(result, result_json)
        except OSError as exc:
            err.write(
                f"obsckpt demo: error: --result-json {result_json} could not be written "
                f"({exc.strerror or exc}); the run itself is as reported above\n"
            )
            return result.exit_code or EXIT_FAILED
    return result.exit_code


def run_demo_detached(args, err: TextIO) -> int:
    """Run `obsckpt demo` in a driver process of its own session; returns its exit code.

    A terminal, ``timeout``, ``kill -- -PGID`` or a CI runner signals the whole
    process group, and the local Ray cluster a driver starts (GCS, raylet) is in
    the driver's group: such a signal used to stop the cluster under the driver.
    Here it reaches this process alone, which passes SIGINT, SIGTERM and SIGHUP on
    to the driver; the driver then stops the cluster in order. Should the driver
    not end within DEMO_KILL_AFTER_S of SIGTERM or SIGHUP, its process group is
    killed (a commit is atomic: that loses saves in flight, never a committed step).
    """
    t_start = time.monotonic()
    first: list[int] = []  # the first stop signal
    driver: subprocess.Popen | None = None

    def pass_on(signum, _frame) -> None:
        if not first:
            first.append(signum)
            if signum != signal.SIGINT:  # a second Ctrl-C, not a timer, stops a Ctrl-C'd run
                signal.alarm(DEMO_KILL_AFTER_S)
        if driver is not None:
            try:
                driver.send_signal(signum)
            except ProcessLookupError:
                pass

    def overdue(_signum, _frame) -> None:
        if driver is not None:
            try:
                os.killpg(driver.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    signal.signal(signal.SIGALRM, overdue)
    for sig in DEMO_STOP_SIGNALS:
        signal.signal(sig, pass_on)
    code = -first[0] if first else None  # stopped before the driver started: none starts
    if code is None:
        driver = subprocess.Popen(
            # This command again, as it was started (`obsckpt ...`, `python -m obsckpt ...`).
            [sys.executable, *sys.orig_argv[1:]],
            env=dict(os.environ, **{DEMO_DRIVER_ENV: str(os.getpid())}),
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        if first:  # came while it was being started
            driver.send_signal(first[0])
        code = driver.wait()
        signal.alarm(0)
        _end_session(driver.pid)
    if code >= 0:
        return code
    # The driver wrote no last line: killed before it took the signals, by SIGKILL,
    # or here when overdue.
    stopped_by = first[0] if first else -code
    if first and code == -signal.SIGKILL and stopped_by != signal.SIGKILL:
        err.write(
            f"obsckpt demo: the job did not stop within {DEMO_KILL_AFTER_S} s of "
            f"{_signal_name(stopped_by)}; killed it\n"
        )
    how = (
        "interrupted"
        if stopped_by == signal.SIGINT
        else f"terminated by {_signal_name(stopped_by)}"
    )
    err.write(
        f"demo {how}: committed checkpoint {_opt(_committed(args.ckpt_dir))}, "
        f"{time.monotonic() - t_start:.1f} s\n"
    )
    return 128 + stopped_by


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _end_session(sid: int) -> None:
    """Kill whatever is left in the driver's session once the driver has exited.

    Its Ray processes are in it (the driver leads it; Ray's workers lead process
    groups of their own in it). The driver shuts them down, but a raylet stopped
    while it was starting may leave its agents behind, and a driver killed
    outright leaves workers until they notice their raylet is gone. Returns once
    they are gone (at most a few seconds).
    """
    try:
        os.killpg(sid, signal.SIGKILL)
    except OSError:
        pass
    deadline = time.monotonic() + 3.0
    while True:
        left = _session_members(sid)
        if not left or time.monotonic() > deadline:
            return
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.05)


def _session_members(sid: int) -> list[int]:
    """The live processes of session ``sid`` (Linux: read from /proc; elsewhere none)."""
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    members = []
    for name in entries:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        # pid (comm) state ppid pgrp session ...; comm may hold spaces and parentheses.
        fields = stat[stat.rindex(")") + 2 :].split()
        if len(fields) > 3 and fields[3] == str(sid) and fields[0] not in ("Z", "X"):
            members.append(int(name))
    return members


def _committed(ckpt_dir: str) -> int | None:
    """The step the checkpoint iteration file in ``ckpt_dir`` names (None: none readable)."""
    try:
        return reader.read_iteration(Path(ckpt_dir).expanduser(), "checkpoint")
    except (IterationFileError, OSError):
        return None


def _become_driver(supervisor: str) -> None:
    """Set up the demo's driver process, started by run_demo_detached.

    Until the demo takes the stop signals (run_demo, after its imports), each
    ends the process, and the `obsckpt demo` process writes the last line. If
    that process is killed outright (SIGKILL, out of memory) it cannot pass a
    signal on: the driver then gets SIGTERM, and shuts its Ray cluster down.
    """
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(pr_set_pdeathsig, signal.SIGTERM)
    # Checked after prctl: a parent that dies from here on sends SIGTERM.
    if str(os.getppid()) != supervisor:
        raise CliError(
            f"{DEMO_DRIVER_ENV}={supervisor!r} is set, but this process was not started by "
            f"the `obsckpt demo` process it names; unset {DEMO_DRIVER_ENV} (obsckpt demo "
            "sets it for its own driver process only)"
        )


class _Lossy:
    """A text stream whose output is dropped once it cannot be written (EIO, EPIPE)."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self.gone = False

    def write(self, text: str) -> int:
        if not self.gone:
            try:
                self._stream.write(text)
            except OSError:
                self.gone = True
        return len(text)

    def flush(self) -> None:
        if not self.gone:
            try:
                self._stream.flush()
            except OSError:
                self.gone = True

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def finish_line(result) -> str:
    """The demo's last line: how it ended, which steps it trained, what is committed."""
    if result.last_step >= result.first_step:
        trained = f"steps {result.first_step}-{result.last_step}"
        if result.first_step == result.last_step:
            trained = f"step {result.first_step}"
    else:
        trained = "no step trained"
    return (
        f"demo {result.stop_reason}: {trained}, committed checkpoint "
        f"{_opt(result.committed.get('checkpoint'))}, {result.elapsed_s:.1f} s"
    )


def check_result_json(path: str) -> Path:
    """The absolute --result-json path; CliError when it cannot be written."""
    target = Path(path).expanduser().resolve()
    if target.is_dir():
        raise CliError(f"--result-json {target} is a directory; pass the path of a file")
    if not target.parent.is_dir():
        raise CliError(
            f"--result-json {target}: {target.parent} is not an existing directory; "
            "create it first or pass a path in an existing directory"
        )
    if not os.access(target.parent, os.W_OK | os.X_OK) or (
        target.exists() and not os.access(target, os.W_OK)
    ):
        raise CliError(f"--result-json {target} is not writable by this user")
    return target


def write_result_json(result, path: Path) -> None:
    """Write the run's result as JSON, atomically (a reader never sees half of it)."""
    from dataclasses import asdict

    data = asdict(result)
    if data.get("summary"):
        data["summary"]["rows"] = [asdict(r) for r in result.summary["rows"]]
    commit.atomic_write(path, (json.dumps(data, indent=2, default=str) + "\n").encode())


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a port number 0-65535, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be 0-65535, got {value}")
    return value


def _int_from(minimum: int, maximum: int | None = None, what: str = "an integer"):
    """An argparse type for whole numbers in a range; argparse names the flag in its error."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None
        if value < minimum or (maximum is not None and value > maximum):
            bound = f">= {minimum}" if maximum is None else f"from {minimum} to {maximum}"
            raise argparse.ArgumentTypeError(f"must be {what} {bound}, got {value}")
        return value

    return parse


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds, got {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(
            f"must be a positive, finite number of seconds, got {text}"
        )
    return value


def _step(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a step number, got {text!r}") from None
    if not 0 <= value <= validators.MAX_STEP:
        raise argparse.ArgumentTypeError(
            f"must be a step number from 0 to 2**63 - 1 (a global_step_<N> directory), got {value}"
        )
    return value


def build_parser() -> argparse.ArgumentParser:
    from obsckpt import __version__

    p = argparse.ArgumentParser(
        prog="obsckpt",
        description="Crash-consistent, observable async checkpointing for Ray RL training.",
    )
    p.add_argument("--version", action="version", version=f"obsckpt {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    d = sub.add_parser(
        "demo",
        help="run a small FSDP2 job that checkpoints through obsckpt",
        description="Train a tiny causal LM with FSDP2 on Ray ranks, checkpoint it in the "
        "background through obsckpt, sync weights to a rollout actor, serve metrics and "
        "print a summary. docs/demo.md in the source distribution describes it.",
    )
    d.add_argument(
        "--steps",
        type=_int_from(0),
        default=40,
        help="training steps; 0 runs until stopped (default 40)",
    )
    d.add_argument(
        "--save-every",
        type=_int_from(1),
        default=10,
        help="full checkpoint every N steps (default 10)",
    )
    d.add_argument(
        "--world-size",
        type=_int_from(1),
        default=None,
        help="trainer ranks (default 2 on CPU, 1 on a single GPU, a GPU each with more)",
    )
    d.add_argument(
        "--sync-method",
        choices=("broadcast", "checkpoint", "ipc", "memory"),
        default=None,
        help="how weights reach the rollout each step (default broadcast; ipc on a single GPU)",
    )
    d.add_argument(
        "--ckpt-dir",
        default=os.path.join("obsckpt-demo", "ckpt"),
        help="checkpoint root (default ./obsckpt-demo/ckpt)",
    )
    d.add_argument("--resume", action="store_true", help="continue from the newest committed step")
    d.add_argument(
        "--duration",
        type=_seconds,
        default=None,
        metavar="SECONDS",
        help="stop after training this long (start-up not counted); the last step is saved",
    )
    d.add_argument(
        "--metrics-port", type=_port, default=0, help="/metrics port; 0 picks a free one (default)"
    )
    d.add_argument(
        "--metrics-host", default="0.0.0.0", help="interface for /metrics (default 0.0.0.0)"
    )
    d.add_argument(
        "--no-metrics", action="store_true", help="serve no /metrics endpoint (no summary)"
    )
    d.add_argument(
        "--file-sd", default=None, metavar="PATH", help="write a Prometheus file_sd target file"
    )
    d.add_argument(
        "--otlp-endpoint",
        default=None,
        metavar="URL",
        help="send traces by OTLP/HTTP to URL (or set the OTEL_* variables)",
    )
    d.add_argument(
        "--address", default=None, help="join this Ray cluster (default: start a local one)"
    )
    d.add_argument("--namespace", default=None, help="Ray namespace (default: a fresh one)")
    d.add_argument(
        "--save-strategy",
        default="unrestricted",
        choices=("single_thread", "single_process", "single_node", "unrestricted"),
        help="admission of concurrent saves (default unrestricted)",
    )
    d.add_argument(
        "--keep",
        type=_int_from(0),
        default=3,
        help="full checkpoints to keep; 0 keeps all (default 3)",
    )
    d.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="default auto")
    d.add_argument(
        "--seed",
        type=_int_from(0, MAX_SEED, "a seed"),
        default=0,
        help="seed of the model's initial weights and of the synthetic batches (default 0)",
    )
    d.add_argument("--no-progress", action="store_true", help="no progress line")
    d.add_argument(
        "--verbose", action="store_true", help="show the Ray workers' logs and tracebacks"
    )
    d.add_argument(
        "--result-json", default=None, metavar="PATH", help="write the run's result as JSON"
    )

    s = sub.add_parser("status", help="committed and uncommitted steps of a checkpoint directory")
    s.add_argument("dir", metavar="DIR", help="the checkpoint root")
    s.add_argument("--json", action="store_true", help="machine-readable output")

    v = sub.add_parser("verify", help="check a committed step against its manifest")
    v.add_argument("dir", metavar="DIR", help="the checkpoint root")
    g = v.add_mutually_exclusive_group()
    g.add_argument(
        "--step", type=_step, default=None, help="step to check (default: the latest committed)"
    )
    g.add_argument(
        "--all",
        action="store_true",
        help="check every step that has a manifest (steps removed by retention are skipped)",
    )
    v.add_argument("--json", action="store_true", help="machine-readable output")
    return p


def main(
    argv: list[str] | None = None, *, out: TextIO | None = None, err: TextIO | None = None
) -> int:
    """Entry point of the ``obsckpt`` command; returns the exit code."""
    out = out or sys.stdout
    err = err or sys.stderr
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse has printed its usage message
        return int(exc.code or 0)
    if argv is None and args.command == "demo":
        # A closed terminal (SIGHUP) or log reader must not turn an orderly stop into
        # an error: what the demo prints from then on is dropped.
        out = sys.stdout = _Lossy(out)
        err = sys.stderr = _Lossy(err)
    logging.basicConfig(
        level=logging.INFO if getattr(args, "verbose", False) else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    try:
        if args.command == "status":
            return cmd_status(args, out)
        if args.command == "verify":
            return cmd_verify(args, out, err)
        if argv is None:  # the `obsckpt demo` command itself, not a call from Python
            supervisor = os.environ.pop(DEMO_DRIVER_ENV, None)
            if supervisor is None and os.name == "posix":
                return run_demo_detached(args, err)
            if supervisor is not None:
                _become_driver(supervisor)
        return cmd_demo(args, out, err)
    except CliError as exc:
        err.write(f"obsckpt {args.command}: error: {exc}\n")
        return EXIT_USAGE
    except OSError as exc:
        err.write(f"obsckpt {args.command}: error: {exc}\n")
        return EXIT_USAGE if args.command != "demo" else EXIT_FAILED
    except KeyboardInterrupt:
        # Ctrl-C outside the demo's own handling (its start-up, say): no traceback.
        err.write(f"obsckpt {args.command}: interrupted\n")
        return EXIT_INTERRUPTED
    except Exception as exc:  # noqa: BLE001 - one line unless asked for the traceback
        if getattr(args, "verbose", False):
            raise
        hint = " (run with --verbose for the traceback)" if args.command == "demo" else ""
        err.write(f"obsckpt {args.command}: error: {one_line(exc)}{hint}\n")
        return EXIT_FAILED


def one_line(exc: BaseException) -> str:
    """``Type: message`` on one line; a Ray task error is named by its task and its cause.

    The text of a RayTaskError holds the remote traceback, many lines long.
    """
    cause = getattr(exc, "cause", None)
    if isinstance(cause, BaseException) and type(exc).__name__.startswith("RayTaskError"):
        # Raised as RayTaskError(<cause's type>); its text starts "ray::Actor.method()".
        named = re.search(r"ray::([\w.]+)\(", str(exc))
        return f"{named.group(1) if named else 'a Ray task'} failed: {one_line(cause)}"
    text = " ".join(str(exc).split()) or "(no message)"
    return f"{type(exc).__name__}: {text}"


if __name__ == "__main__":
    sys.exit(main())
