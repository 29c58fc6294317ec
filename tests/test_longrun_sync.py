"""Weight sync for days: what the Synchronizer and the ipc receiver keep stays bounded.

The Synchronizer is used in-process (its methods are async) against real
files; the ipc sender and receiver run on the CPU, through real shared-memory
files.
"""

from __future__ import annotations

import asyncio
import gc
import weakref

import torch
from broadcast_helpers import ipc_pair, new_group
from prometheus_client import CollectorRegistry

from obsckpt.store import commit, layout
from obsckpt.sync.synchronizer import Synchronizer

KEEP = 64  # failed steps the Synchronizer keeps for status()


class TestSynchronizerForgetsOldLoadFailures:
    """A job whose committed steps cannot be loaded for hours keeps status() the size of
    the newest failures; every failure is still counted, and none is retried."""

    def test_failed_steps_keep_the_newest(self, tmp_path):
        root = tmp_path / "ckpt"
        sync = Synchronizer(str(root), registry=CollectorRegistry())
        n = 200

        async def main():
            for step in range(1, n + 1):
                shard = layout.model_dir(root, step) / layout.shard_name("model", 1, 0)
                shard.parent.mkdir(parents=True)
                shard.write_bytes(b"not a torch file")
                commit.write_iteration(root, "state_dict", step)
                await sync.poll_once()
            await sync.poll_once()  # the newest failed step is not loaded again
            return await sync.status()

        status = asyncio.run(main())
        assert status["load_failures"] == n
        assert sorted(status["failed_steps"]) == list(range(n - KEEP + 1, n + 1))
        assert status["version"] is None


class TestIpcReceiverLetsGoOfRenamedWeights:
    """When the model's tensors are renamed (another layout), the receive area no longer
    holds tensors for the old names: the rollout does not keep a copy of weights that
    are never sent again."""

    def test_old_names_are_freed(self, tmp_path):
        received: dict[str, dict[str, torch.Tensor]] = {}
        first_layouts: list[weakref.ref] = []
        with ipc_pair(tmp_path, bucket_bytes=1 << 12) as (sender, receiver):

            def deliver(payload):
                ack, received["weights"] = receiver.recv(payload)
                return ack

            for step in range(1, 31):
                prefix = f"layout{step % 10}"  # ten namings of the model, in turn
                weights = {f"{prefix}.w{i}": torch.full((16, 16), float(step)) for i in range(4)}
                sender.send(weights, deliver, step=step)
                got = received.pop("weights")
                assert torch.equal(got[f"{prefix}.w3"], weights[f"{prefix}.w3"])
                if step <= 10:
                    first_layouts.append(weakref.ref(got[f"{prefix}.w0"]))
                del got
            gc.collect()
            kept = sum(r() is not None for r in first_layouts)
            assert kept == 0, f"the receiver still holds {kept} tensors of names it was sent before"


class TestBroadcastersGoWithTheirGroups:
    """The broadcaster the verl helpers keep for a weight-sync group, and its buffers,
    live as long as the group: a job that makes a new group for each sync (after a
    broken one, or per rollout restart) does not keep every old group's buffers."""

    def test_closed_groups_are_not_kept(self):
        from obsckpt.integrations.verl_fsdp import broadcaster_for

        alive = []
        for step in range(1, 11):
            group = new_group()
            b = broadcaster_for(group, bucket_bytes=1 << 20)
            assert broadcaster_for(group) is b  # one per group
            b.send({"w": torch.ones(1024)}, step=step)
            group.close()
            alive.append(weakref.ref(group))
            del group, b
        gc.collect()
        kept = sum(ref() is not None for ref in alive)
        assert kept == 0, f"{kept} of {len(alive)} closed groups are still kept"
