"""A patched verl trainer whose checkpoints go to an ``s3://`` root.

The root is ``trainer.default_hdfs_dir`` when that is an ``s3://`` URL (verl then
passes the workers both paths; obsckpt's managers write to the S3 one, and
nothing of the checkpoint goes to local disk), else ``trainer.default_local_dir``
given as an ``s3://`` URL. Around verl's own code:

* the save: verl's ``local_mkdir_safe`` does nothing (of a URL, it would make a
  directory named ``s3:`` in the working directory), and its ``torch.save`` of
  ``data.pt`` becomes one more save of the step, uploaded by the driver;
* the resume replaces verl's ``_load_checkpoint`` (which joins a URL to the
  working directory, and refuses ``default_hdfs_dir``) with the same steps on the
  store: the step the root's pointer names (or ``resume_from_path``), the
  workers' loads, then ``data.pt``, each object checked against the manifest.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
from collections.abc import Iterator
from typing import Any

from obsckpt.store import layout
from obsckpt.store.uri import parse_root

logger = logging.getLogger("obsckpt.integrations.verl_install")


def store_root(config: Any) -> str | None:
    """The ``s3://`` root a trainer config names (``default_hdfs_dir`` first), else None.

    Raises:
        UnsupportedStoreError: either names a URL of another scheme (``hdfs://``,
            ``gs://``, ...); one line naming the setting and the value.
    """
    for key in ("default_hdfs_dir", "default_local_dir"):
        value = getattr(config, key, None)
        if isinstance(value, str) and "://" in value:
            root = parse_root(value, what=f"trainer.{key}")
            if root.is_remote:
                return str(root)
    return None


def refuse_async_modes(trainer: Any, root: str) -> None:
    """A V1 trainer's asynchronous modes save TransferQueue's state as local files into the
    step, which an ``s3://`` root does not hold: refused in one line."""
    mode = getattr(trainer, "trainer_mode", "sync")
    if mode != "sync":
        raise ValueError(
            f"trainer mode {mode!r} with checkpoints in {root}: the asynchronous modes save "
            "TransferQueue's files into the step directory, which obsckpt keeps only on a "
            "local root; use a local trainer.default_local_dir with them, or the sync mode"
        )


@contextlib.contextmanager
def no_local_mkdir() -> Iterator[None]:
    """verl's ``local_mkdir_safe`` does nothing while the trainer's save runs: it makes
    the step's directory for ``data.pt``, which goes to the store (a URL would become a
    directory named ``s3:`` in the working directory)."""
    try:
        import verl.utils.fs as fs
    except ImportError:  # pragma: no cover - verl is what calls it
        yield
        return
    original = fs.local_mkdir_safe
    fs.local_mkdir_safe = lambda path: path
    try:
        yield
    finally:
        fs.local_mkdir_safe = original


def data_file_step(trainer: Any, root: str, path: str) -> int | None:
    """The step of verl's ``data.pt`` at ``path`` (under the root, or under the local
    directory verl also writes to with ``default_hdfs_dir``), else None."""
    if os.path.basename(path) != layout.DATA_FILE:
        return None
    step_dir = os.path.dirname(path)
    step = layout.step_of_dir_name(os.path.basename(step_dir))
    parent = os.path.dirname(step_dir)
    local = trainer.config.trainer.get("default_local_dir", None)
    under = parent == root or (
        isinstance(local, str) and "://" not in local and parent == os.path.abspath(local)
    )
    return step if under else None


def upload_data_file(trainer: Any, link: Any, root: str, step: int, obj: Any, save: Any) -> None:
    """``data.pt`` of ``step`` as one more save of the step (registered first), uploaded
    from the driver; a step already committed is not written again."""
    from obsckpt.coordinator import CheckpointCoordinator
    from obsckpt.store.scratch import scratch_path

    coordinator = getattr(trainer, "_obsckpt_data_coordinator", None)
    if coordinator is None:
        coordinator = CheckpointCoordinator(link.monitor)
        trainer._obsckpt_data_coordinator = coordinator
    url = layout.step_location(root, step, layout.DATA_FILE)
    buffer = io.BytesIO()
    save(obj, buffer)

    def write() -> None:
        local = scratch_path(url, coordinator.rank)
        os.makedirs(os.path.dirname(local), exist_ok=True)
        with open(local, "wb") as f:
            f.write(buffer.getvalue())

    link.register_thread_count(step, checkpoint_thread_count=1)
    coordinator.save_sync(write, step, name="data", paths=[url], unless_committed=True)


def load_checkpoint(trainer: Any, root: str) -> int:
    """verl's ``_load_checkpoint`` on the store: returns the step resumed (0: none)."""
    from obsckpt.store import loading
    from obsckpt.store.s3root import shared_s3_root

    cfg = trainer.config.trainer
    if cfg.resume_mode == "disable":
        return 0
    refuse_async_modes(trainer, root)
    if cfg.resume_mode == "resume_path":
        path = cfg.resume_from_path
        if not (isinstance(path, str) and path.startswith(root + "/")):
            raise ValueError(
                f"trainer.resume_from_path={path!r}: with checkpoints in {root}, name a step "
                f"there ({layout.step_location(root, 1)} for step 1)"
            )
        located = layout.step_of_dir_name(path.rstrip("/").rsplit("/", 1)[-1])
        if located is None:
            raise ValueError(f"trainer.resume_from_path={path!r} names no global_step_<N>")
        step: int | None = located
    else:
        step = shared_s3_root(root).committed("checkpoint")
        if step is None:
            print("Training from scratch")
            return 0
    assert step is not None
    trainer.global_steps = step
    print(f"Resuming from {layout.step_location(root, step)}")
    delete = cfg.get("del_local_ckpt_after_load", False)
    trainer.actor_rollout_wg.load_checkpoint(
        layout.step_location(root, step, "actor"), del_local_after_load=delete
    )
    if trainer.use_critic:
        from verl.trainer.ppo.utils import Role

        trainer.critic_wg.load_checkpoint(
            layout.step_location(root, step, str(Role.Critic)), del_local_after_load=delete
        )
    data = loading.CommittedObjects.of(layout.step_location(root, step))
    url = layout.step_location(root, step, layout.DATA_FILE)
    if layout.DATA_FILE not in data.paths():
        print(f"Warning: No dataloader state found at {url}, will start from scratch")
        return step
    steps_per_epoch = len(trainer.train_dataloader)
    if steps_per_epoch > 0 and step % steps_per_epoch == 0:
        print(f"Skipping dataloader state restore: global_steps={step} is at an epoch boundary")
        return step
    trainer.train_dataloader.load_state_dict(data.torch_load(url))
    return step
