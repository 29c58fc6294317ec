#!/usr/bin/env python
"""obsckpt benchmarks: each measures the obsckpt path against its baseline or physical limit.

    python benchmarks/run.py                 # full run (~18 min on 2 cores)
    python benchmarks/run.py --quick         # smaller sizes, fewer repetitions
    python benchmarks/run.py --json out.json # also write the results as JSON
    python benchmarks/run.py --ray-address HOST:PORT  # on a running Ray cluster

Every benchmark measures obsckpt and its reference in the same run, interleaved
repetition by repetition, and reports the median (commit lag: the p99). See
docs/performance.md for what limits each number.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import sys
import tempfile
import time
import traceback
import uuid

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks.common import SIZES, Result, loadavg, machine_info  # noqa: E402

SMOKE_ENV = "OBSCKPT_BENCH_SMOKE"
BENCHMARKS = (
    "save",
    "load",
    "peers",
    "rss",
    "telemetry",
    "commit_lag",
    "broadcast",
    "delta",
    "publish",
    "s3",
    "gpu",
    "ipc",
)
# Benchmarks another one includes: run alone when named alone.
PART_OF = {"ipc": "gpu"}


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line, checked; a bad value exits 2 naming it, before anything runs."""
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--quick", action="store_true", help="smaller sizes and fewer repetitions (a few minutes)"
    )
    p.add_argument("--smoke", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--json", metavar="PATH", help="write the results as JSON to PATH")
    p.add_argument(
        "--dir",
        metavar="DIR",
        help="where to write checkpoints (default: a temporary directory; its filesystem is measured)",
    )
    p.add_argument(
        "--ray-address",
        metavar="HOST:PORT",
        help="run on this running Ray cluster (its GCS address) instead of starting a local "
        "one; its CPUs are shared with whatever else runs there",
    )
    p.add_argument(
        "--only",
        metavar="NAMES",
        help=f"comma-separated subset of: {', '.join(BENCHMARKS)} (ipc: the colocated sync "
        "alone, a part of gpu)",
    )
    args = p.parse_args(argv)
    # Checked before anything runs: a bad value found after minutes of benchmarks
    # would lose the run (the results are written last).
    choose = f"choose from {', '.join(BENCHMARKS)}"
    if args.only is not None:
        names = [n.strip() for n in args.only.split(",") if n.strip()]
        if not names:
            p.error(f"--only: no benchmark named in {args.only!r}; {choose}")
        unknown = sorted(set(names) - set(BENCHMARKS))
        if unknown:
            p.error(f"--only: unknown benchmark(s) {', '.join(map(repr, unknown))}; {choose}")
        args.only = ",".join(names)
    if args.json is not None:
        _check_json_path(p, args.json)
    if args.dir is not None and os.path.exists(args.dir) and not os.path.isdir(args.dir):
        p.error(f"--dir: {args.dir!r} exists and is not a directory")
    if args.ray_address is not None:
        _check_ray_address(p, args.ray_address)
    return args


def _check_json_path(p: argparse.ArgumentParser, path: str) -> None:
    if os.path.isdir(path):
        p.error(f"--json: {path!r} is a directory; name the file to write the results to")
    parent = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(parent, exist_ok=True)
    except OSError as exc:
        p.error(f"--json: cannot create the folder of {path!r}: {exc.strerror}")
    if not os.access(parent, os.W_OK | os.X_OK):
        p.error(f"--json: cannot write {path!r}: its folder {parent!r} is not writable")
    if os.path.exists(path) and not os.access(path, os.W_OK):
        p.error(f"--json: {path!r} exists and is not writable")


def _check_ray_address(p: argparse.ArgumentParser, address: str) -> None:
    """A ``HOST:PORT`` must have a server behind it; ``ray.init`` would retry for minutes."""
    if address == "auto" or "://" in address:
        return  # Ray resolves these itself
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        p.error(
            f"--ray-address: {address!r} is not HOST:PORT (the GCS address of a running cluster)"
        )
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=5).close()
    except OSError as exc:
        p.error(
            f"--ray-address: nothing answers at {address!r} ({exc}); give the GCS address "
            "of a running Ray cluster (`ray status` prints it)"
        )


def selected(only: str | None) -> list[str]:
    """The benchmarks to run for ``--only`` (all when None), each once, in the order given."""
    wanted = only.split(",") if only else list(BENCHMARKS)
    return [n for n in dict.fromkeys(wanted) if PART_OF.get(n) not in wanted]


def _start_ray(namespace: str, address: str | None = None, env: dict[str, str] | None = None):
    import ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    pythonpath = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    # A cluster of our own is sized to this machine; a running one keeps its size.
    own = {"num_cpus": max(2, os.cpu_count() or 2), "include_dashboard": False}
    ray.init(
        address=address or "local",
        namespace=namespace,
        **({} if address else own),
        log_to_driver=False,
        logging_level="ERROR",
        # The S3 server's AWS variables too, for monitors on an s3:// root.
        runtime_env={"env_vars": {"PYTHONPATH": pythonpath, "RAY_DEDUP_LOGS": "0", **(env or {})}},
    )
    return ray


def _format_value(r: Result) -> str:
    if r.value is None:
        return "—"
    return f"{r.value:.3g}" if abs(r.value) < 1000 else f"{r.value:.0f}"


def table(results: list[Result]) -> str:
    rows = [("benchmark", "value", "unit", "target", "met")]
    for r in results:
        met = (
            "skipped"
            if r.skipped
            else ("error" if r.details.get("error") else ("yes" if r.met else "NO"))
        )
        rows.append((r.name, _format_value(r), r.unit, r.target, met))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for n, row in enumerate(rows):
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    for r in results:
        if r.skipped:
            lines.append(f"  {r.name}: skipped: {r.skipped}")
        elif r.details.get("error"):
            lines.append(f"  {r.name}: error: {r.details['error'].strip().splitlines()[-1]}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    mode = (
        "smoke"
        if args.smoke or os.environ.get(SMOKE_ENV) == "1"
        else ("quick" if args.quick else "full")
    )
    sizes = SIZES[mode]
    wanted = selected(args.only)
    own_dir = args.dir is None
    bench_dir = tempfile.mkdtemp(prefix="obsckpt-bench-") if own_dir else os.path.abspath(args.dir)
    os.makedirs(bench_dir, exist_ok=True)
    run_id = uuid.uuid4().hex[:8]
    if mode != "full":
        _log(
            f"obsckpt benchmarks: {mode} mode (smaller sizes, fewer repetitions; targets are set for the full run)"
        )
    else:
        _log("obsckpt benchmarks: full run")
    _log(f"  checkpoint directory: {bench_dir}")

    results: list[Result] = []
    errors = 0
    t_start = time.time()
    ray = None
    s3_server = None
    try:
        if "s3" in wanted:
            from benchmarks.s3 import start_server

            s3_server = start_server(bench_dir)
        s3_env = s3_server.env() if s3_server is not None and s3_server.started else None
        if s3_env:
            os.environ.update(s3_env)
        if {"save", "peers", "rss", "telemetry", "commit_lag", "s3", "publish"} & set(wanted):
            ray = _start_ray(f"obsckpt-bench-{run_id}", args.ray_address, s3_env)
        for name in wanted:
            # The previous benchmark's files are written back and its deleted ones
            # freed (and discarded, on a filesystem mounted with discard) now, not
            # during this benchmark's measurements.
            t_sync = time.perf_counter()
            os.sync()
            _log(f"[{name}] (sync before it: {time.perf_counter() - t_sync:.2f} s)")
            load_before = loadavg()
            t0 = time.perf_counter()
            try:
                got = _run_one(name, sizes, bench_dir, run_id, ray, s3_server)
            except Exception:  # noqa: BLE001 - one broken benchmark must not hide the others
                errors += 1
                tb = traceback.format_exc()
                _log(tb)
                got = [Result(name, None, "<=", 0, details={"error": tb})]
            elapsed = time.perf_counter() - t0
            for r in got:
                r.details.setdefault("seconds", round(elapsed, 1))
                r.details.setdefault(
                    "loadavg_1m_before_after", [round(load_before, 2), round(loadavg(), 2)]
                )
            results.extend(got)
    finally:
        if ray is not None and ray.is_initialized():
            ray.shutdown()
        if s3_server is not None:
            s3_server.stop()
        if own_dir:
            shutil.rmtree(bench_dir, ignore_errors=True)

    print(f"\nobsckpt benchmarks ({mode} run, {time.time() - t_start:.0f} s)")
    print(table(results))
    if args.json:
        doc = {
            "results": {r.name: r.to_json() for r in results},
            "machine": machine_info(bench_dir),
            "mode": mode,
            "seconds": round(time.time() - t_start, 1),
            "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=2, default=str)
            f.write("\n")
        print(f"results written to {args.json}")
    return 1 if errors else 0


def _with_monitor(name: str, bench_dir: str, run_id: str, ray, bench, sizes) -> list[Result]:
    """Run ``bench(sizes, dir, monitor, log)`` against a monitor of its own, killed afterwards."""
    from obsckpt import CheckpointMonitor

    monitor = CheckpointMonitor.get_actor(
        namespace=f"obsckpt-bench-{run_id}-{name}",
        default_local_dir=os.path.join(bench_dir, name),
    )
    try:
        return bench(sizes, bench_dir, monitor, _log)
    finally:
        ray.kill(monitor)


def _run_one(name: str, sizes, bench_dir: str, run_id: str, ray, s3_server=None) -> list[Result]:
    if name == "save":
        from benchmarks.save import run_save_benchmarks

        return _with_monitor(name, bench_dir, run_id, ray, run_save_benchmarks, sizes)
    if name == "s3":
        from benchmarks.s3 import run_s3

        return run_s3(sizes, bench_dir, _log, s3_server, ray, f"obsckpt-bench-{run_id}-s3")
    if name == "load":
        from benchmarks.load import run_verified_load

        return run_verified_load(sizes, bench_dir, _log)
    if name == "peers":
        from benchmarks.peers import run_peers

        return _with_monitor(name, bench_dir, run_id, ray, run_peers, sizes)
    if name == "rss":
        from benchmarks.rss import run_peak_rss

        address = ray.get_runtime_context().gcs_address
        return [run_peak_rss(sizes, bench_dir, address, f"obsckpt-bench-{run_id}-rss", _log)]
    if name == "telemetry":
        from benchmarks.telemetry import run_telemetry_overhead

        return [run_telemetry_overhead(sizes, bench_dir, f"obsckpt-bench-{run_id}-telemetry", _log)]
    if name == "commit_lag":
        from benchmarks.commit_lag import run_commit_lag

        return [run_commit_lag(sizes, bench_dir, f"obsckpt-bench-{run_id}-commit", _log)]
    if name == "broadcast":
        from benchmarks.broadcast import run_broadcast, run_nccl_broadcast

        return run_broadcast(sizes, _log) + run_nccl_broadcast(sizes, _log)
    if name == "publish":
        from benchmarks.shared_snapshot import run_shared_snapshot

        return _with_monitor(name, bench_dir, run_id, ray, run_shared_snapshot, sizes)
    if name == "delta":
        from benchmarks.delta import run_delta

        return run_delta(sizes, _log)
    if name == "gpu":
        from benchmarks.gpu import run_gpu_benchmarks

        return run_gpu_benchmarks(sizes, _log) + _run_one("ipc", sizes, bench_dir, run_id, ray)
    if name == "ipc":
        from benchmarks.gpu_sync import run_gpu_ipc_sync

        return [run_gpu_ipc_sync(sizes, _log)]
    raise ValueError(f"unknown benchmark {name!r}")


if __name__ == "__main__":
    sys.exit(main())
