"""The checkpoint managers' steps on an ``s3://`` root: the files verl writes beside its
shards, the names a world-size check reads and a verified local copy, each on objects instead of a
directory (retention is :func:`obsckpt.integrations.retention.prune`'s, on either).

The shards themselves need nothing here: the coordinator streams each into its
object (:meth:`~obsckpt.CheckpointCoordinator.save_state_dict_async`). Imports
neither verl nor boto3 at module level.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from obsckpt.store import layout
from obsckpt.store.scratch import prune, scratch_path


def is_url(path: str | os.PathLike | None) -> bool:
    """Whether ``path`` is an object URL (``s3://...``), not a local path."""
    return isinstance(path, str) and "://" in path


def join(base: str, *names: str) -> str:
    """``base/names...``: a URL joined with ``/``, a local path with :func:`os.path.join`."""
    return "/".join([base.rstrip("/"), *names]) if is_url(base) else os.path.join(base, *names)


def save_metadata(
    coordinator: Any,
    url: str,
    step: int,
    write: Callable[[str], Any],
) -> bool:
    """Write a step's small files (HF config, tokenizer, ``fsdp_config.json``) to ``url``.

    ``write(directory)`` writes them into a local scratch directory; each file
    or directory it wrote is then uploaded as one state-dict save of the step
    (slot ``hf_metadata``, registered here, so the step's model commits only
    with them, as on a local root), unless the step is committed already.
    Returns whether anything was saved.
    """
    local = scratch_path(url, coordinator.rank)
    os.makedirs(local, exist_ok=True)
    write(local)
    names = sorted(os.listdir(local))
    if not names:
        prune(local)
        return False
    coordinator.link.register_thread_count(step, state_dict_thread_count=1)
    coordinator.save_sync(
        lambda: None,
        step,
        True,
        name="hf_metadata",
        paths=[f"{url}/{name}" for name in names],
        unless_committed=True,
    )
    prune(local)
    return True


def step_of(url: str) -> tuple[str, int] | None:
    """(root URL, step) of an object URL inside a ``global_step_<N>`` prefix, else None."""
    from obsckpt.store.s3root import split_step_url

    try:
        root, step, _ = split_step_url(url.rstrip("/") + "/-")
    except ValueError:
        return None
    return root, step


def names_under(url: str, listed: set[str]) -> set[str]:
    """The names, relative to ``url`` (a prefix in a step), of the step's manifest
    paths ``listed`` under it."""
    located = step_of(url)
    if located is None:
        return set()
    sub = url.rstrip("/")[len(layout.step_location(*located)) + 1 :]
    return {p[len(sub) + 1 :] for p in listed if p.startswith(sub + "/")} if sub else listed


def written_at(url: str, rank: int | None) -> tuple[str, list[str] | None]:
    """Where a save function that writes files itself writes ``url``, and the ``paths=``
    of its save: for a URL, its scratch path (uploaded after the save), else the path
    itself, written in place (None: the files are found by the commit)."""
    if is_url(url):
        return scratch_path(url, rank), [url]
    return url, None


class VerifiedCopy:
    """The files under ``url`` (in a committed step of an ``s3://`` root), downloaded to a
    local directory for a loader that reads files itself (Megatron's distributed
    checkpoint): each object is checked against the step's manifest (size, ETag,
    CRC32) as it is read, and a file the manifest does not list is never there.
    Inside :func:`obsckpt.store.loading.verified_torch_load` (``step=`` this copy), the
    loader's ``torch.load`` calls must name files of the copy and load weights only.
    """

    def __init__(self, url: str, directory: str) -> None:
        from obsckpt.store.loading import CommittedObjects

        self.url = url.rstrip("/")
        self.dir = directory
        self.objects = CommittedObjects.of(self.url)

    def fetch(self) -> int:
        """Download every listed file under the URL; the number of files."""
        prefix = self.objects.path_of(self.url + "/-")[:-1]
        paths = [p for p in sorted(self.objects.paths()) if p.startswith(prefix)]
        if not paths:
            from obsckpt.errors import UnverifiedCheckpointError

            raise UnverifiedCheckpointError(
                f"{self.url}: the committed step's manifest lists no file under it"
            )
        for path in paths:
            data = self.objects.read_bytes(f"{self.objects.url}/{path}")
            local = os.path.join(self.dir, *path[len(prefix) :].split("/"))
            os.makedirs(os.path.dirname(local), exist_ok=True)
            with open(local, "wb") as f:
                f.write(data)
        return len(paths)

    def torch_load(self, path: str, map_location: Any = None) -> Any:
        from obsckpt.errors import UnverifiedCheckpointError
        from obsckpt.store.loading import safe_torch_load

        if not os.path.abspath(path).startswith(os.path.abspath(self.dir) + os.sep):
            raise UnverifiedCheckpointError(
                f"a checkpoint loader read {path}, outside the verified copy of {self.url}: "
                "obsckpt verifies files of a committed step only"
            )
        return safe_torch_load(path, f"{path} (of {self.url})", map_location=map_location)

    def remove(self) -> None:
        import shutil

        shutil.rmtree(self.dir, ignore_errors=True)
        prune(os.path.dirname(self.dir))
