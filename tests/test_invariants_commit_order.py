"""Each iteration file moves forward on its own: a full checkpoint that completes after later
state dicts were committed is committed, and the state-dict iteration file stays where it is.

The monitor is used in-process (its RPCs are async methods) with real files.
"""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry

from obsckpt import CheckpointMonitor
from obsckpt.store import layout, reader


def _write(root, step: int, name: str) -> None:
    path = layout.step_dir(root, step) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"w" * 256)


def test_a_checkpoint_older_than_the_committed_state_dict_commits(tmp_path):
    """Checkpoint of step 5 still saving while state dicts of steps 6 and 7 commit: once it
    finishes, latest_checkpointed_iteration.txt names 5, latest_state_dict_iteration.txt
    still names 7, and nothing failed."""
    root = tmp_path / "root"
    m = CheckpointMonitor(default_local_dir=root, metrics_port=None, registry=CollectorRegistry())

    async def run() -> None:
        await m.register_thread_count(5, checkpoint_thread_count=1)
        slow = await m.notify_started("n", "j", step=5, slot="model", kind="checkpoint")
        await m.monitor_step(5)
        for step in (6, 7):
            await m.register_thread_count(step, state_dict_thread_count=1)
            t = await m.notify_started("n", "j", step=step, slot="sd", kind="state_dict")
            _write(root, step, "actor/model.pt")
            await m.notify_finished(step, True, ticket=t["ticket"], slot="sd")
            await m.monitor_step(step, is_state_dict=True)
        assert reader.read_iteration(root, "state_dict") == 7
        _write(root, 5, "actor/model.pt")
        _write(root, 5, "actor/optim.pt")
        await m.notify_finished(5, False, ticket=slow["ticket"], slot="model")

    asyncio.run(run())
    status = asyncio.run(m.status())
    assert status["failed"] == [] and status["pending"] == []
    assert status["latest"] == {"checkpoint": 5, "state_dict": 7}
    assert reader.read_iteration(root, "checkpoint") == 5
    assert reader.read_iteration(root, "state_dict") == 7
    assert reader.verify_step(layout.step_dir(root, 5)) == []
