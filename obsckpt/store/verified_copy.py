"""A committed step's files downloaded for a loader that reads files itself (Megatron's
distributed checkpoint): the verified read path, writing a local copy.

Each object is checked against the step's manifest (size, ETag, CRC32) as it is
read; only files the manifest lists are written; inside
:func:`obsckpt.store.loading.verified_torch_load` the loader may load only files
of the copy, weights only.
"""

from __future__ import annotations

import os
from typing import Any

from obsckpt.store.scratch import prune


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
