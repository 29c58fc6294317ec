"""The monitor's commit I/O: a whole step made durable and named by its iteration file.

Runs in a worker thread of the monitor actor (never on its event loop); the
state machine that chose the step is :class:`obsckpt.monitor.core.MonitorCore`.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

from obsckpt import commit, layout, reader
from obsckpt.layout import FileRecord


def storage_hint(exc: OSError, root: str | os.PathLike[str]) -> str:
    """What to do about a commit that failed on the storage, by its cause."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        what = f"Free space (or inodes) on the filesystem of {root}"
    elif exc.errno == errno.EROFS:
        what = f"Remount the filesystem of {root} read-write"
    elif exc.errno in (errno.EACCES, errno.EPERM):
        what = f"Let this process create files in {root} and its step directories"
    elif exc.errno == errno.ENOENT:
        what = f"Leave the step directories under {root} in place until they are committed"
    else:
        what = f"Check the filesystem of {root}"
    return f"{what}; the next step commits once it can be written"


class StepWriter:
    """Commits steps under one checkpoint root.

    Args:
        root: the checkpoint root.
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        # Whether this process sees the step directories the workers write: then a
        # step directory missing at commit was removed, not written on another node.
        self.sees_step_dirs = bool(reader.steps_on_disk(root))

    def has_step_dir(self, step: int) -> bool:
        return layout.step_dir(self.root, step).is_dir()

    def write(
        self, step: int, kind: str, files: dict[str, FileRecord], phases: dict[str, float]
    ) -> None:
        """fsync ``step``'s files, write its manifest and move the iteration file(s).

        Raises:
            OSError: the step directory is gone or the storage refused a write.
        """
        sdir = layout.step_dir(self.root, step)
        if sdir.is_dir():
            self.sees_step_dirs = True
        elif files and self.sees_step_dirs:
            # Committing it would name a step that is not on disk.
            raise FileNotFoundError(
                errno.ENOENT,
                f"the step directory was removed or renamed after its saves reported "
                f"{len(files)} file(s) in it",
                str(sdir),
            )
        steps = {kind: step}
        if kind == "checkpoint":
            # A full checkpoint also commits its state dict.
            current = reader.read_iteration(self.root, "state_dict")
            if current is None or current < step:
                steps["state_dict"] = step
        commit.finalize_step(sdir, files, iterations=steps, timings=phases)
