"""Snapshot a state dict into reusable staging buffers; write it durably.

The training loop is blocked only for :meth:`StagingBuffers.stage`: one copy
of each tensor into a buffer kept from the previous save of the same slot
(pinned host memory when CUDA is present, so device→host copies run at
full bandwidth). :func:`write_torch_file` then runs in the background.
"""

from __future__ import annotations

import copy
import os
import zlib
from typing import Any

import torch

from obsckpt.commit import FileRecord, fsync_dir

try:  # DTensor shards (FSDP2) are staged as their local tensor plus placement.
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - torch without distributed
    DTensor = None  # type: ignore[assignment,misc]


def _signature(t: torch.Tensor) -> tuple:
    return (tuple(t.shape), t.dtype)


class StagingBuffers:
    """Host buffers for one slot, reused while the state dict keeps its shapes."""

    def __init__(self, pin_memory: bool | None = None) -> None:
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self._buffers: list[torch.Tensor] = []
        self._cursor = 0

    @property
    def bytes_allocated(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers)

    def _buffer_for(self, t: torch.Tensor) -> torch.Tensor:
        i = self._cursor
        self._cursor += 1
        if i < len(self._buffers) and _signature(self._buffers[i]) == _signature(t):
            return self._buffers[i]
        buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=self.pin_memory)
        if i < len(self._buffers):
            self._buffers[i] = buf
        else:
            self._buffers.append(buf)
        return buf

    def stage(self, obj: Any) -> Any:
        """A copy of ``obj`` whose tensors live in this slot's staging buffers.

        Returns once every copy has completed, so the caller may mutate its
        tensors immediately. Containers are rebuilt; other leaves are deep-copied.
        """
        self._cursor = 0
        out = self._stage(obj)
        del self._buffers[self._cursor :]
        if self.pin_memory and torch.cuda.is_available():
            torch.cuda.synchronize()
        return out

    def _stage(self, obj: Any) -> Any:
        if DTensor is not None and isinstance(obj, DTensor):
            local = self._stage(obj.to_local())
            return DTensor.from_local(
                local,
                obj.device_mesh,
                obj.placements,
                run_check=False,
                shape=obj.shape,
                stride=obj.stride(),
            )
        if isinstance(obj, torch.Tensor):
            src = obj.detach()
            buf = self._buffer_for(src)
            buf.copy_(src, non_blocking=self.pin_memory and src.is_cuda)
            return buf
        if isinstance(obj, dict):
            return type(obj)((k, self._stage(v)) for k, v in obj.items())
        if isinstance(obj, list):
            return [self._stage(v) for v in obj]
        if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
            return tuple(self._stage(v) for v in obj)
        return copy.deepcopy(obj)


class _CrcWriter:
    """A binary file wrapper that checksums what passes through it."""

    def __init__(self, f) -> None:
        self._f = f
        self.crc = 0
        self.size = 0

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        self.crc = zlib.crc32(view, self.crc)
        self.size += view.nbytes
        return self._f.write(view)

    def flush(self) -> None:
        self._f.flush()


def write_torch_file(obj: Any, path: str | os.PathLike) -> FileRecord:
    """``torch.save`` to a temp file, fsync, rename into place, fsync the directory."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "wb") as raw:
            writer = _CrcWriter(raw)
            torch.save(obj, writer)
            raw.flush()
            os.fsync(raw.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    fsync_dir(directory)
    return FileRecord(path=os.path.abspath(path), size=writer.size, crc32=writer.crc)
