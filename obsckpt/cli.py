"""The ``obsckpt`` command: run the demo job, inspect and verify checkpoint directories.

::

    obsckpt demo [--steps N] [--save-every N] [--world-size N] [...]
    obsckpt status DIR [--json]
    obsckpt verify DIR [--step N | --all] [--json]
    obsckpt dashboards export DIR [--runbook-url URL]

Exit codes: 0 success; 1 a check failed (``verify``), ``status`` reported a
problem (an iteration file naming a step that is not on disk), or the demo
failed; 2 bad usage, a directory that is missing, is not a checkpoint root, or
holds an unreadable iteration file, or (``demo``) the ``demo`` extra is not
installed; 128 + the signal's number when a signal stopped the demo (130
SIGINT, 143 SIGTERM, 129 SIGHUP).
"""

from __future__ import annotations

import argparse
import difflib
import json
import logging
import math
import os
import re
import sys
from collections.abc import Callable
from typing import Any, TextIO

from obsckpt import inspection, inspection_s3, monitor_link, validators
from obsckpt.assets import RUNBOOK_URL_ENV
from obsckpt.demo import endpoints
from obsckpt.demo.config import (
    DEVICES,
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    MARKER,
    MAX_SEED,
    SAVE_STRATEGIES,
    SYNC_METHODS,
    DemoConfig,
    flag_names,
    kill_in_save_problem,
    missing_demo_modules,
)
from obsckpt.demo.driver import become_driver, run_detached
from obsckpt.demo.result import finish_line, validate_result_json, write_result_json
from obsckpt.errors import CliError
from obsckpt.inspection_s3 import is_remote_dir
from obsckpt.options import OBSCKPT_DEMO_DRIVER
from obsckpt.store import layout, repair, rootlock
from obsckpt.store.uri import parse_root

# The demo's root marker: a directory holding it is a root before its first save.
DEMO_MARKER = MARKER

# Bad usage, a directory that cannot be used, or (demo) a missing extra; the others,
# shared with the demo's result, are in obsckpt.demo.config.
EXIT_USAGE = 2

# The defaults `obsckpt demo --help` states are DemoConfig's.
_DEMO_DEFAULTS = DemoConfig()


# ----------------------------------------------------------------------
# Commands
# ----------------------------------------------------------------------


def cmd_status(args: argparse.Namespace, out: TextIO) -> int:
    """``obsckpt status DIR [--json]``: 1 when the root has a problem."""
    if is_remote_dir(args.dir):
        return inspection_s3.cli_status(args.dir, args.json, out)
    root, latest = inspection.open_root(args.dir, markers=(DEMO_MARKER,))
    st = inspection.root_status(root, latest)
    if args.json:
        out.write(json.dumps(st, indent=2) + "\n")
    else:
        out.write(inspection.format_status(st) + "\n")
    return EXIT_FAILED if st["problems"] else EXIT_OK


def cmd_verify(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """``obsckpt verify DIR [--step N | --all] [--json]``: 1 unless every step checked is whole.

    A step of a root obsckpt never committed in is NOT VERIFIABLE (no manifest to
    check against), said apart from FAILED, and exits 1 too.
    """
    if is_remote_dir(args.dir):
        return inspection_s3.cli_verify(args.dir, args, out, err)
    root, latest = inspection.open_root(args.dir, markers=(DEMO_MARKER,))
    results = inspection.verify_root(root, latest, step=args.step, every=args.all, shown=args.dir)
    if args.json:
        out.write(json.dumps(inspection.verify_report(root, results), indent=2) + "\n")
    else:
        for r in results:
            problems, line = inspection.verify_lines(r)
            for p in problems:
                err.write(p + "\n")
            out.write(line + "\n")
    # A step not written by obsckpt is not vouched for either: 1, with its own word.
    return EXIT_OK if all(r["result"] == "ok" for r in results) else EXIT_FAILED


def cmd_dashboards(args: argparse.Namespace, out: TextIO) -> int:
    """Write this version's Grafana dashboard, alert rules and scrape snippet to DIR."""
    from obsckpt import assets

    for path in assets.export(args.dir, runbook_link=args.runbook_url):
        print(path, file=out)
    return EXIT_OK


def cmd_repair(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """``obsckpt repair DIR [--dry-run]``: rewind iteration files naming a step that is not
    whole, or holding no step number at all.

    Deletes nothing. 0 when every iteration file names a whole step afterwards
    (or did already), 1 with ``--dry-run`` when one does not.
    """
    if is_remote_dir(args.dir):
        raise CliError(inspection_s3.REPAIR_NOT_NEEDED.format(root=args.dir))
    root, _latest = inspection.open_root(args.dir, markers=(DEMO_MARKER,), repairing=True)
    holder = rootlock.locked_by(root)
    if holder is not None and not args.dry_run:
        raise CliError(
            f"{args.dir}: a running monitor holds this root ({rootlock.describe_holder(holder)}); "
            "stop its job before repairing it"
        )
    bad = repair.check_iterations(root, checksums=True)
    if not bad:
        out.write("every iteration file names a whole step; nothing to repair\n")
        return EXIT_OK
    if args.dry_run:
        for b in bad:
            out.write(b.describe() + "\n")
        return EXIT_FAILED
    for line in repair.rewind(root, bad, log=False):  # printed here, not logged as well
        out.write(line + "\n")
    return EXIT_OK


def cmd_demo(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """``obsckpt demo``: run the job here; its exit code (128 + N when signal N stopped it)."""
    # Checked before Ray starts: without it the job dies in its first worker
    # with a remote traceback.
    missing = missing_demo_modules()
    if missing:
        raise CliError(
            f"the demo needs {', '.join(missing)}, which {'is' if len(missing) == 1 else 'are'} "
            "not installed; install the demo extra: pip install 'obsckpt[demo]'"
        )
    from obsckpt.demo import run_demo
    from obsckpt.errors import DemoError

    if args.kill_at and args.kill_at[1] and args.kill_at[0] % args.save_every:
        raise CliError(kill_in_save_problem(args.kill_at[0], args.save_every))
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
            kill_at=args.kill_at[0] if args.kill_at else None,
            kill_in_save=bool(args.kill_at and args.kill_at[1]),
            check_resume=args.check_resume,
        )
    except ValueError as exc:
        raise CliError(flag_names(str(exc))) from None
    # Checked before the run, not found out after it.
    result_json = validate_result_json(args.result_json) if args.result_json else None
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


def _ckpt_dir(text: str) -> str:
    """A local directory or ``s3://bucket/prefix``: another URL (gs://) is refused, never
    taken for a relative path."""
    try:
        root = parse_root(text, what="--ckpt-dir")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return str(root) if root.is_remote else text


def _kill_at(text: str) -> tuple[int, bool]:
    """``K`` or ``K:save``: (step, whether mid-save)."""
    step, _, when = text.partition(":")
    try:
        value = int(step)
    except ValueError:
        value = 0
    if value < 1 or when not in ("", "save"):
        raise argparse.ArgumentTypeError(f"must be a step K >= 1 or K:save, got {text!r}")
    return value, when == "save"


def _step(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a step number, got {text!r}") from None
    if not 0 <= value <= validators.MAX_STEP:
        raise argparse.ArgumentTypeError(
            "must be a step number from 0 to 2**63 - 1 "
            f"(a {layout.STEP_DIR_PREFIX}<N> directory), got {value}"
        )
    return value


def _checked(check: Callable[..., str], **kwargs: Any) -> Callable[[str], str]:
    """An argparse type from a check that returns the value or raises a ValueError saying
    why (argparse names the flag in its error)."""

    def parse(text: str) -> str:
        try:
            return check(text, **kwargs)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse


# What a runbook URL looks like, for the error that refuses one.
RUNBOOK_EXAMPLE = "https://wiki.example.com/obsckpt/runbook.md"


def build_parser() -> argparse.ArgumentParser:
    """The ``obsckpt`` command's parser: ``demo``, ``status`` and ``verify``."""
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
        default=_DEMO_DEFAULTS.steps,
        help=f"training steps; 0 runs until stopped (default {_DEMO_DEFAULTS.steps})",
    )
    d.add_argument(
        "--save-every",
        type=_int_from(1),
        default=_DEMO_DEFAULTS.save_every,
        help=f"full checkpoint every N steps (default {_DEMO_DEFAULTS.save_every})",
    )
    d.add_argument(
        "--world-size",
        type=_int_from(1),
        default=_DEMO_DEFAULTS.world_size,
        help="trainer ranks (default 2 on CPU, 1 on a single GPU, a GPU each with more)",
    )
    d.add_argument(
        "--sync-method",
        choices=SYNC_METHODS,
        default=_DEMO_DEFAULTS.sync_method,
        help="how weights reach the rollout each step (default broadcast; ipc on a single GPU)",
    )
    d.add_argument(
        "--ckpt-dir",
        default=_DEMO_DEFAULTS.ckpt_dir,
        type=_ckpt_dir,
        help=f"checkpoint root (default {os.path.join(os.curdir, _DEMO_DEFAULTS.ckpt_dir)})",
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
        "--metrics-port",
        type=_port,
        default=_DEMO_DEFAULTS.metrics_port,
        help="/metrics port; 0 picks a free one (default)",
    )
    d.add_argument(
        "--metrics-host",
        default=_DEMO_DEFAULTS.metrics_host,
        help=f"interface for /metrics (default {_DEMO_DEFAULTS.metrics_host})",
    )
    d.add_argument(
        "--no-metrics", action="store_true", help="serve no /metrics endpoint (no summary)"
    )
    d.add_argument(
        "--file-sd", default=None, metavar="PATH", help="write a Prometheus file_sd target file"
    )
    d.add_argument(
        "--otlp-endpoint",
        type=_checked(endpoints.otlp_endpoint),
        default=None,
        metavar="URL",
        help="send traces by OTLP/HTTP to URL, e.g. http://localhost:4318 (or set the "
        "OTEL_* variables)",
    )
    d.add_argument(
        "--address",
        type=_checked(endpoints.ray_address),
        default=None,
        help="join this Ray cluster: HOST:PORT of its head, ray://HOST:PORT or auto "
        "(default: start a local one)",
    )
    d.add_argument("--namespace", default=None, help="Ray namespace (default: a fresh one)")
    d.add_argument(
        "--save-strategy",
        default=_DEMO_DEFAULTS.save_strategy,
        choices=SAVE_STRATEGIES,
        help=f"admission of concurrent saves (default {_DEMO_DEFAULTS.save_strategy})",
    )
    d.add_argument(
        "--keep",
        type=_int_from(0),
        default=_DEMO_DEFAULTS.keep,
        help=f"full checkpoints to keep; 0 keeps all (default {_DEMO_DEFAULTS.keep})",
    )
    d.add_argument(
        "--device",
        choices=DEVICES,
        default=_DEMO_DEFAULTS.device,
        help=f"default {_DEMO_DEFAULTS.device}",
    )
    d.add_argument(
        "--seed",
        type=_int_from(0, MAX_SEED, "a seed"),
        default=_DEMO_DEFAULTS.seed,
        help="seed of the model's initial weights and of the synthetic batches "
        f"(default {_DEMO_DEFAULTS.seed})",
    )
    d.add_argument("--no-progress", action="store_true", help="no progress line")
    d.add_argument(
        "--verbose", action="store_true", help="show the Ray workers' logs and tracebacks"
    )
    d.add_argument(
        "--result-json", default=None, metavar="PATH", help="write the run's result as JSON"
    )
    d.add_argument(
        "--kill-at",
        type=_kill_at,
        default=None,
        metavar="K[:save]",
        help="SIGKILL the job (its ranks, rollout and driver) after step K, or with K:save "
        "while step K's checkpoint is being written; then try --resume",
    )
    d.add_argument(
        "--check-resume",
        default=None,
        metavar="REF_JSON",
        help="compare the run with REF_JSON, the --result-json of an uninterrupted run with "
        "the same seed: weights, optimizer, RNGs, data order and weight versions, bit for bit",
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
        help="check every step that has a manifest",
    )
    v.add_argument("--json", action="store_true", help="machine-readable output")
    r = sub.add_parser(
        "repair",
        help="point iteration files that name a step that is not whole at the latest whole "
        "step (deletes nothing)",
    )
    r.add_argument("dir", metavar="DIR", help="the checkpoint root")
    r.add_argument(
        "--dry-run", action="store_true", help="say what would change; exit 1 if anything would"
    )
    db = sub.add_parser("dashboards", help="the Grafana dashboard and alert rules of this version")
    dbs = db.add_subparsers(dest="dashboards_command", required=True, metavar="ACTION")
    ex = dbs.add_parser(
        "export",
        help="write the dashboard JSON, the Prometheus alert rules and a scrape config snippet",
    )
    ex.add_argument("dir", metavar="DIR", help="directory to write them into (made if missing)")
    ex.add_argument(
        "--runbook-url",
        type=_checked(validators.validate_url, example=RUNBOOK_EXAMPLE),
        default=None,
        metavar="URL",
        help="absolute URL of docs/runbook.md for the alerts' runbook links "
        "(default $OBSCKPT_RUNBOOK_URL, else the project's runbook of this version)",
    )
    return p


def _subparser(
    parser: argparse.ArgumentParser, args: argparse.Namespace
) -> argparse.ArgumentParser:
    """The parser of the (sub)command ``args`` come from, whose usage its errors show."""
    # argparse has no public accessor for a subcommand's parser.
    for name in filter(None, (args.command, getattr(args, "dashboards_command", None))):
        parser = parser._subparsers._group_actions[0].choices[name]  # type: ignore[union-attr,index]
    return parser


def _unrecognized(sub: argparse.ArgumentParser, extra: list[str]) -> None:
    """Exit as argparse does, with the subcommand's usage and a suggestion for a misspelled flag."""
    # argparse has no public accessor for a parser's flags.
    known = list(sub._option_string_actions)
    hints = []
    for arg in extra:
        close = difflib.get_close_matches(arg.split("=", 1)[0], known, n=1, cutoff=0.6)
        if arg.startswith("-") and close:
            hints.append(f"{arg} (did you mean {close[0]}?)")
        else:
            hints.append(arg)
    sub.error(f"unrecognized arguments: {' '.join(hints)}")


def _check_environment(sub: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Exit as argparse does when a URL the command takes from the environment is none."""
    try:
        if args.command == "demo":
            endpoints.check_otel_environment(args.otlp_endpoint)
        elif args.command == "dashboards" and args.runbook_url is None:
            url = os.environ.get(RUNBOOK_URL_ENV)
            if url:
                validators.validate_url(url, RUNBOOK_URL_ENV, example=RUNBOOK_EXAMPLE)
    except ValueError as exc:
        sub.error(str(exc))


def main(
    argv: list[str] | None = None, *, out: TextIO | None = None, err: TextIO | None = None
) -> int:
    """Entry point of the ``obsckpt`` command; returns the exit code."""
    out = out or sys.stdout
    err = err or sys.stderr
    parser = build_parser()
    try:
        args, extra = parser.parse_known_args(argv)
        if extra:  # the subcommand's usage, and the flag meant where one is close
            _unrecognized(_subparser(parser, args), extra)
        _check_environment(_subparser(parser, args), args)
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
        if args.command == "repair":
            return cmd_repair(args, out, err)
        if args.command == "dashboards":
            return cmd_dashboards(args, out)
        if argv is None:  # the `obsckpt demo` command itself, not a call from Python
            supervisor = os.environ.pop(OBSCKPT_DEMO_DRIVER, None)
            if supervisor is None and os.name == "posix":
                return run_detached(args.ckpt_dir, err)
            if supervisor is not None:
                become_driver(supervisor)
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
    return monitor_link.one_line(exc)


if __name__ == "__main__":
    sys.exit(main())
