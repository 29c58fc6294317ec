"""``obsckpt status`` and ``obsckpt verify`` of an ``s3://`` root.

The pointer is the truth on an object store: status shows its owner, epoch and
committed steps, the steps with objects under the root (committed, or not whole:
objects but no manifest), and a problem when an iteration object lags the pointer
or a committed step's objects no longer match its manifest. Verify checks each
step's objects against its manifest (HEAD for sizes and ETags, then a ranged GET of
every byte for the CRC32), as for a local root; the results have a local root's shape.
"""

from __future__ import annotations

import json
from typing import Any, TextIO

from obsckpt.errors import CliError, StoreError, UnsupportedStoreError
from obsckpt.store import layout
from obsckpt.store.s3root import S3Root, open_s3_root
from obsckpt.store.uri import parse_root

REPAIR_NOT_NEEDED = (
    "{root}: an s3:// root needs no repair: its pointer names only whole steps, and the "
    "next monitor to take the root brings its iteration objects up to it"
)


def is_remote_dir(value: str) -> bool:
    """Whether a command's DIR is an ``s3://`` root (anything else is the local path's checks')."""
    try:
        return parse_root(value, what="DIR").is_remote
    except (UnsupportedStoreError, ValueError):
        return False


def cli_status(url: str, as_json: bool, out: TextIO) -> int:
    """``obsckpt status s3://...``: 1 when the root has a problem."""
    st = status(open_store(url))
    out.write((json.dumps(st, indent=2) if as_json else format_status(st)) + "\n")
    return 1 if st["problems"] else 0


def cli_verify(url: str, args: Any, out: TextIO, err: TextIO) -> int:
    """``obsckpt verify s3://...``: 1 unless every step checked is whole."""
    from obsckpt.inspection import verify_lines

    store = open_store(url)
    results = verify(store, step=args.step, every=args.all)
    ok = all(r["result"] == "ok" for r in results)
    if args.json:
        out.write(json.dumps({"root": store.url, "ok": ok, "steps": results}, indent=2) + "\n")
    else:
        for r in results:
            problems, line = verify_lines(r)
            err.writelines(p + "\n" for p in problems)
            out.write(line + "\n")
    return 0 if ok else 1


def open_store(url: str) -> S3Root:
    """The root ``url`` names; CliError when it cannot be read (one line)."""
    try:
        store = open_s3_root(url, "DIR")
        pointer = store.read_pointer()
        if pointer is None and not store.steps():
            raise CliError(f"{url}: not a checkpoint root (no obsckpt pointer and no steps)")
    except (UnsupportedStoreError, ValueError, StoreError, ModuleNotFoundError) as exc:
        raise CliError(f"{url}: {exc}") from None
    return store


def status(store: S3Root) -> dict[str, Any]:
    """The root's state, as ``obsckpt status --json`` prints it."""
    pointer = store.read_pointer()
    latest = (
        {k: pointer.step(k) for k in layout.KINDS}
        if pointer is not None
        else store.committed_steps()
    )
    problems: list[str] = []
    for kind in layout.KINDS:
        blob = store.client.read(store.key(layout.ITERATION_FILES[kind]))
        named = None if blob is None else blob.data.strip().decode(errors="replace")
        if latest[kind] is not None and named != str(latest[kind]):
            problems.append(
                f"{layout.ITERATION_FILES[kind]} names {named or 'nothing'}, the pointer "
                f"{latest[kind]}; the next monitor to take the root brings it up"
            )
    steps = []
    newest = max((s for s in latest.values() if s is not None), default=None)
    for step in store.steps():
        try:
            records = store.manifest(step)
        except ValueError as exc:
            problems.append(str(exc))
            records = None
        if records is None:
            state = "not whole (no manifest)"
        elif newest is None or step > newest:
            state = "not whole (its commit did not move the pointer)"
        else:
            found = store.check_reported(step, {r.path: r for r in records})
            state = "damaged" if found else "committed"
            problems += [f"step {step}: {p}" for p in found]
        steps.append({"step": step, "state": state, "files": len(records or [])})
    return {
        "root": store.url,
        "endpoint": store.endpoint,
        "owner": None if pointer is None else pointer.owner,
        "epoch": None if pointer is None else pointer.epoch,
        "latest": latest,
        "steps": steps,
        "problems": problems,
    }


def format_status(st: dict[str, Any]) -> str:
    lines = [
        f"root: {st['root']} (endpoint {st['endpoint']})",
        f"owner: {st['owner'] or 'none yet'} (epoch {st['epoch'] or '-'})",
    ]
    for kind in layout.KINDS:
        lines.append(f"latest {kind}: {st['latest'][kind]}")
    for s in st["steps"]:
        lines.append(f"  {layout.step_dir_name(s['step'])}: {s['state']}, {s['files']} files")
    lines += [f"PROBLEM: {p}" for p in st["problems"]] or ["no problems"]
    return "\n".join(lines)


def verify(store: S3Root, *, step: int | None, every: bool) -> list[dict[str, Any]]:
    """Results of checking steps (the latest committed, ``step`` or ``every`` one), in
    :func:`obsckpt.inspection.verify_one`'s shape."""
    latest = store.committed_steps()
    newest_committed = max((v for v in latest.values() if v is not None), default=None)
    if every:
        steps = store.steps()
    elif step is not None:
        steps = [step]
    else:
        newest = latest["checkpoint"] if latest["checkpoint"] is not None else latest["state_dict"]
        if newest is None:
            raise CliError(f"{store.url}: no committed step to verify; pass --step")
        steps = [newest]
    results = []
    for s in steps:
        try:
            records = store.manifest(s)
        except ValueError as exc:
            records, problems = [], [str(exc)]
        else:
            if records is None:
                problems = []
            elif newest_committed is None or s > newest_committed:
                problems = [
                    f"{store.url_of(store.step_key(s))}: step {s} has a manifest but the "
                    "root's pointer has not reached it; its commit did not finish, so it is "
                    "not committed"
                ]
            else:  # the manifest just read, not read again
                problems = store.verify_step(s, records=records)
        on_disk = bool(records) or store.has_objects(s)
        if records is None:
            result = "unverifiable" if on_disk else "failed"
            if not on_disk:
                problems = [f"{store.url_of(store.step_key(s))}: no objects"]
        else:
            result = "failed" if problems else "ok"
        results.append(
            {
                "step": s,
                "result": result,
                "on_disk": on_disk,
                "files": len(records or []),
                "bytes": sum(r.size for r in records or []),
                "problems": problems,
            }
        )
    return results
