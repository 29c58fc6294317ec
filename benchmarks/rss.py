"""Peak extra resident memory of an async save, measured in a fresh process.

The parent runs ``python -m benchmarks.rss`` once per repetition; the child
builds the state, records its resident set, resets the kernel's high-water mark
(``/proc/self/clear_refs``), saves, and reports ``VmHWM - VmRSS(before)``. A
sampling thread backs the high-water mark up where it cannot be reset.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time

from benchmarks.common import Result, Sizes, median

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class _Sampler(threading.Thread):
    def __init__(self) -> None:
        super().__init__(name="rss-sampler", daemon=True)
        self.peak = _status_kib("VmRSS")
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            self.peak = max(self.peak, _status_kib("VmRSS"))
            time.sleep(0.001)


def _measure(coord, state, path: str, step: int) -> dict:
    import gc

    gc.collect()
    base = _status_kib("VmRSS")
    reset = _reset_hwm()
    sampler = _Sampler()
    sampler.start()
    coord.save_state_dict_async("model", state, path, step, is_state_dict=True)
    coord.wait_all()
    sampler.stop.set()
    sampler.join()
    hwm = _status_kib("VmHWM") if reset else 0
    peak = max(hwm, sampler.peak)
    return {
        "base_kib": base,
        "peak_kib": peak,
        "hwm_reset": reset,
        "extra_bytes": (peak - base) * 1024,
    }


def child(args: argparse.Namespace) -> None:
    import ray

    from benchmarks.save import make_state, state_nbytes
    from obsckpt import CheckpointCoordinator, CheckpointMonitor

    ray.init(
        address=args.address, namespace=args.namespace, logging_level="ERROR", log_to_driver=False
    )
    monitor = CheckpointMonitor.get_actor(namespace=args.namespace, default_local_dir=args.dir)
    coord = CheckpointCoordinator(monitor, rank=0)
    state = make_state(args.bytes, args.tensors, seed=1)
    nbytes = state_nbytes(state)
    base = args.step * 10
    path = os.path.join(args.dir, f"global_step_{base}", "actor", "model_world_size_1_rank_0.pt")
    first = _measure(coord, state, path, base)
    # Steady state: the staging buffers already exist; only the writer's buffers are new.
    path2 = os.path.join(
        args.dir, f"global_step_{base + 1}", "actor", "model_world_size_1_rank_0.pt"
    )
    steady = _measure(coord, state, path2, base + 1)
    print(json.dumps({"state_bytes": nbytes, "first": first, "steady": steady}), flush=True)
    ray.shutdown()


def run_peak_rss(sizes: Sizes, bench_dir: str, address: str, namespace: str, log) -> Result:
    import shutil

    root = os.path.join(bench_dir, "rss")
    os.makedirs(root, exist_ok=True)
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    )
    runs = []
    for rep in range(sizes.rss_reps):
        cmd = [
            sys.executable,
            "-m",
            "benchmarks.rss",
            "--address",
            address,
            "--namespace",
            namespace,
            "--dir",
            root,
            "--bytes",
            str(sizes.state_bytes),
            "--tensors",
            str(sizes.state_tensors),
            "--step",
            str(rep + 1),
        ]
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            raise RuntimeError(f"peak-RSS child failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
        if not lines:
            raise RuntimeError(
                f"peak-RSS child exited 0 without its JSON line:\n{proc.stdout[-2000:]}"
                f"\n{proc.stderr[-4000:]}"
            )
        runs.append(json.loads(lines[-1]))
        first = runs[-1]["first"]
        log(
            f"  rss rep {rep + 1}/{sizes.rss_reps}: first save +{first['extra_bytes'] / 2**20:.0f} MiB, "
            f"steady +{runs[-1]['steady']['extra_bytes'] / 2**20:.0f} MiB"
        )
        for entry in os.listdir(root):
            shutil.rmtree(os.path.join(root, entry), ignore_errors=True)
    shutil.rmtree(root, ignore_errors=True)
    nbytes = runs[0]["state_bytes"]
    firsts = [r["first"]["extra_bytes"] / nbytes for r in runs]
    steadies = [r["steady"]["extra_bytes"] / nbytes for r in runs]
    return Result(
        "peak_extra_rss_ratio",
        median(firsts),
        "<=",
        1.15,
        unit="x state",
        limit="one staging copy of the state (1.0x) is the design; the rest is writer buffers",
        details={
            "state_bytes": nbytes,
            "reps": len(runs),
            "first_save_ratio_samples": [round(x, 4) for x in firsts],
            "steady_save_ratio": round(median(steadies), 4),
            "hwm_reset": all(r["first"]["hwm_reset"] for r in runs),
            "measured_in": "fresh subprocess per repetition; VmHWM after resetting it, and a 1 ms RSS sampler",
        },
    )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--address", required=True)
    p.add_argument("--namespace", required=True)
    p.add_argument("--dir", required=True)
    p.add_argument("--bytes", type=int, required=True)
    p.add_argument("--tensors", type=int, required=True)
    p.add_argument("--step", type=int, required=True)
    child(p.parse_args())


if __name__ == "__main__":
    main()
