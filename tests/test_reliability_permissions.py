"""Weights are not readable by other users of the host.

On the CPU the ipc weight sync's buckets are files in ``/dev/shm``, which
every local user shares. They were made 0o666 and left to the umask: 0o644
under the usual 022 (the weights readable by any local user), 0o666 under
000. They are now made 0600, whatever the umask.

In-process, no Ray: the sender and receiver are the same inside the actors.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import torch

from obsckpt.sync.ipc import IpcWeightReceiver, IpcWeightSender


def _weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed": torch.randn(37, 11, generator=g),
        "bf16": torch.randn(3, 5, 7, generator=g).to(torch.bfloat16),
        "step": torch.tensor(seed, dtype=torch.int64),
    }


def _sync_once(sender: IpcWeightSender) -> None:
    receiver = IpcWeightReceiver()
    try:
        sender.send(_weights(1), lambda p: receiver.recv(p)[0], step=1)
    finally:
        receiver.close()


@pytest.fixture(params=[0o000, 0o022], ids=["umask000", "umask022"])
def umask(request):
    old = os.umask(request.param)
    try:
        yield request.param
    finally:
        os.umask(old)


class TestSharedMemoryBuckets:
    """A bucket file is 0600 under any umask: only its user (the job) can read it."""

    def test_shared_memory_buckets_are_readable_by_their_user_only(self, tmp_path, umask):
        sender = IpcWeightSender(device="cpu", shm_dir=str(tmp_path))
        try:
            _sync_once(sender)
            files = list(tmp_path.iterdir())
            assert files
            for path in files:
                assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
        finally:
            sender.close()

    @pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm on this platform")
    def test_buckets_in_the_default_dev_shm_are_0600(self, umask):
        """Made where a sender puts them by default: the world-shared /dev/shm itself."""
        sender = IpcWeightSender(device="cpu")
        made: list[str] = []
        try:
            assert sender.shm_dir == "/dev/shm"
            _sync_once(sender)
            made = list(sender._paths)
            assert made
            for path in made:
                assert Path(path).parent == Path("/dev/shm"), path
                assert stat.S_IMODE(os.stat(path).st_mode) == 0o600, path
        finally:
            sender.close()
            for path in made:
                if os.path.exists(path):
                    os.unlink(path)
        assert not any(os.path.exists(p) for p in made), "close() left files in /dev/shm"
