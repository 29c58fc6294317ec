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

from obsckpt import commit, layout, reader
from obsckpt.layout import FileRecord


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


def run_and_record(save_fn: Callable[[], Any], paths: list[str] | None) -> list[FileRecord]:
    """Run ``save_fn``, then make what it wrote under ``paths`` durable and checksum it.

    A path that is a directory stands for every file under it (temp files of
    unfinished writes excepted); its directories are fsynced too.

    Raises:
        FileNotFoundError: a path in ``paths`` was not written.
    """
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
    return FileRecord(path=path, size=rec.size, crc32=rec.crc32).to_json()
