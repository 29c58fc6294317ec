"""What a save wrote, made durable and checksummed on the node that wrote it.

A save names the files (or directories) its function writes; once the
function returns they are fsynced and their sizes and CRC32s recorded here,
so the monitor's commit neither reads them back nor misses them when it runs
on another node. Records travel to the monitor relative to their step
directory.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import Any

from obsckpt.errors import SavePathError, UnsupportedStoreError
from obsckpt.store import commit, layout, reader
from obsckpt.store.layout import FileRecord
from obsckpt.store.s3root import S3Root, locate_in_root, shared_s3_root
from obsckpt.store.scratch import run_and_upload
from obsckpt.store.uri import is_remote, local_root, parse_root


def path_list(paths: Iterable[str | os.PathLike] | None) -> list[str] | None:
    """``paths`` as a list of strings (None stays None).

    Raises:
        ValueError: ``paths`` is one path, not a list of them.
    """
    if paths is None:
        return None
    if isinstance(paths, (str, bytes, os.PathLike)):
        raise ValueError(
            f"paths must be a list of files or directories, got the single path {paths!r}; "
            "pass [path]"
        )
    return [os.fspath(p) for p in paths]


def check_targets(
    paths: Iterable[str], *, root: str, step: int, slot: str, through_temp: bool = False
) -> None:
    """Refuse any of ``paths`` outside ``<root>/global_step_<step>``, before anything is written.

    A save's step commits only what is under its own step directory: a path in
    another step's directory (a committed one's file would change under its
    manifest), in the root itself (the iteration files), or outside any step is
    refused here, in the caller, instead of after the write. The path is
    checked as spelled and as it resolves, so a symbolic link out of the step
    (say ``global_step_6/actor`` pointing at ``global_step_4/actor``) is refused
    too. With ``through_temp`` (obsckpt writes the file through a temp file
    beside it) a file name too long for the temp suffix is refused as well.

    Raises:
        SavePathError: one line naming the path, the step directory it lies in
            and the save's step (or the name and the length limit).
    """
    if is_remote(root):
        _check_object_targets(paths, root=root, step=step, slot=slot)
        return
    own = layout.step_dir(root, step)
    for path in paths:
        try:
            local_root(path, "path")
        except UnsupportedStoreError as exc:  # a URL, never a relative path of that name
            raise SavePathError(
                f"save {slot!r} of step {step} refused before writing {path!r}: it is a URL, "
                f"not a path in its own step directory {own} ({exc})"
            ) from None
        where = os.path.abspath(path)
        lies = _outside(path, root, step)
        why = None if lies is None else f"it {lies}"
        real = os.path.realpath(path)
        if why is None and real != where:
            resolved = _outside(real, os.path.realpath(root), step)
            if resolved is not None:
                why = f"it resolves through a symbolic link to {real}, which {resolved}"
        if why is not None:
            raise SavePathError(
                f"save {slot!r} of step {step} refused before writing {where}: {why}, not in "
                f"its own step directory {own}; write each step's files under its own directory"
            )
        if through_temp:
            try:
                layout.check_temp_room(path)
            except ValueError as exc:
                raise SavePathError(
                    f"save {slot!r} of step {step} refused before writing {where}: {exc}"
                ) from None


def _check_object_targets(paths: Iterable[str], *, root: str, step: int, slot: str) -> None:
    """``check_targets`` for an ``s3://`` root: each path an object URL in the step's prefix."""
    parsed = parse_root(root)
    own = f"{root}/{layout.step_dir_name(step)}/"
    for path in paths:
        try:
            located = locate_in_root(parsed, path)
        except UnsupportedStoreError as exc:
            raise SavePathError(f"save {slot!r} of step {step} refused: {exc}") from None
        if located is None or located[0] != step:
            raise SavePathError(
                f"save {slot!r} of step {step} refused before writing {path!r}: the monitor "
                f"commits under {root}, so give an s3:// URL under {own}"
            )


def object_destination(root: str, path: str) -> tuple[S3Root, int, str] | None:
    """(root, step, path in the step) when ``path`` is an object of the ``s3://`` ``root``
    (which :func:`check_targets` has checked), else None (a local root)."""
    if not is_remote(root):
        return None
    store = shared_s3_root(root)
    located = store.locate(path)
    if located is None:
        raise SavePathError(f"{path!r} is not an object in a step of {root}")
    return store, located[0], located[1]


def _outside(path: str, root: str, step: int) -> str | None:
    """Where ``path`` lies when not in ``root``'s directory of ``step`` ("lies in ..."), or None."""
    located = layout.step_of_path(path)
    if located is not None and located[1] == step and _same_dir(located[0], root):
        return None
    if located is None:
        return "lies in no global_step_<N> directory (obsckpt commits only step directories)"
    if located[1] != step:
        return f"lies in step directory {layout.step_dir(*located)} (step {located[1]})"
    return (
        f"lies in step directory {layout.step_dir(*located)} of another root "
        f"(the monitor commits under {root})"
    )


def _same_dir(a: str, b: str) -> bool:
    a, b = os.path.abspath(a), os.path.abspath(b)
    return a == b or os.path.realpath(a) == os.path.realpath(b)


def run_and_record(
    save_fn: Callable[[], Any],
    paths: list[str] | None,
    root: str | None = None,
    rank: int | None = None,
) -> list[FileRecord]:
    """Run ``save_fn``, then make what it wrote under ``paths`` durable and checksum it.

    With an ``s3://`` ``root``, ``paths`` are object URLs: ``save_fn`` writes at
    their scratch paths (of ``rank``) and the files are uploaded (see
    :mod:`obsckpt.store.scratch`).

    A path that is a directory stands for every file under it (temp files of
    unfinished writes excepted); its directories are fsynced too.

    Raises:
        FileNotFoundError: a path in ``paths`` was not written.
    """
    if root is not None and is_remote(root):
        return run_and_upload(save_fn, paths, shared_s3_root(root), rank)
    save_fn()
    if not paths:
        return []
    files: list[str] = []
    dirs: set[str] = set()
    for path in map(os.path.abspath, paths):
        if os.path.isdir(path):
            for dirpath, names in reader.walk_files(path):
                files += [os.path.join(dirpath, n) for n in names]
                dirs.add(dirpath)
        elif os.path.isfile(path):
            files.append(path)
        else:
            raise FileNotFoundError(
                f"{path} is named in paths= but the save function did not write it (or it "
                "is not a regular file or directory): name only what the save writes"
            )
        dirs.add(os.path.dirname(path))
    files = list(dict.fromkeys(files))  # a file named and inside a named directory: once
    # Concurrent fsyncs share journal commits; the checksums then read the page cache.
    commit.fsync_many([(f, False) for f in files] + [(d, True) for d in sorted(dirs)])
    records = []
    for path in files:
        size, crc = reader.file_crc32(path)
        records.append(FileRecord(path=path, size=size, crc32=crc))
    return records


def relative_record(rec: FileRecord, step: int) -> dict:
    """``rec`` as JSON, its path relative to its ``step`` directory if inside one."""
    located = layout.step_of_path(rec.path)
    path = rec.path
    if located is not None and located[1] == step:
        path = os.path.relpath(os.path.abspath(rec.path), layout.step_dir(*located))
    return FileRecord(path=path, size=rec.size, crc32=rec.crc32, etag=rec.etag).to_json()
