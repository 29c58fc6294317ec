"""obsckpt's exceptions cross process boundaries whole: type, message and attributes.

Ray hands an actor's exception to ``ray.get`` by pickling it, and so does
multiprocessing; an exception that cannot be rebuilt reaches the caller as
Ray's unpickling error instead of the save's own failure.
"""

from __future__ import annotations

import importlib
import inspect
import os
import pickle

import pytest
import ray

from obsckpt import CheckpointMonitor, SaveError
from obsckpt import errors as obsckpt_errors

MODULES = [
    "obsckpt.errors",
    "obsckpt.cli",
    "obsckpt.monitor_link",
    "obsckpt.demo.root",
    "obsckpt.demo.job",
    "obsckpt.sync.group",
    "obsckpt.sync.device",
    "obsckpt.sync.shards",
    "obsckpt.sync.ipc.payload",
]

# Exceptions with state of their own, made with a value for each (the others
# take a message alone).
WITH_ARGS = {"StartupStopped": ((15,), {"signum": 15})}
WITH_STATE = {
    "SaveError": dict(slot="optimizer", step=7),
    "SaveTimeoutError": dict(slot="model", step=8),
    "PartsMismatchError": dict(failed=[(3, "checkpoint")]),
    "RootInUseError": dict(holder={"host": "node-1", "pid": 42}),
    **{
        name: dict(operation="put_if_match", key="run/obsckpt-pointer.json", status=412)
        for name in (
            "StoreError",
            "PreconditionFailed",
            "ConditionalConflict",
            "ObjectNotFoundError",
            "StoreCheckError",
        )
    },
    "StoreUnavailableError": dict(
        operation="put", key="run/x", status="timeout", maybe_applied=False
    ),
    "ConditionalWritesUnsupportedError": dict(
        endpoint="http://127.0.0.1:8333", check="create-only put over an existing key"
    ),
    "FencedError": dict(root="s3://ckpt/run", epoch=3, new_epoch=4),
}


def exception_classes():
    found = {}
    for name in MODULES:
        module = importlib.import_module(name)
        for cls_name, cls in vars(module).items():
            if (
                inspect.isclass(cls)
                and issubclass(cls, BaseException)
                and cls.__module__.startswith("obsckpt")
            ):
                found[cls_name] = cls
    return sorted(found.items())


@pytest.mark.parametrize("name,cls", exception_classes(), ids=lambda v: getattr(v, "__name__", v))
def test_every_exception_pickles_whole(name, cls):
    state = WITH_STATE.get(name, {})
    args, attrs = WITH_ARGS.get(name, ((f"{name} happened to /ckpt/global_step_7",), {}))
    exc = cls(*args, **state)
    state = {**state, **attrs}
    exc.add_note("while saving step 7")
    again = pickle.loads(pickle.dumps(exc))
    assert type(again) is cls
    assert str(again) == str(exc) and again.args == exc.args
    assert again.__notes__ == ["while saving step 7"]
    for attr, value in state.items():
        assert getattr(again, attr) == value


def test_the_table_names_only_existing_exceptions():
    names = {n for n, _ in exception_classes()}
    assert set(WITH_STATE) | set(WITH_ARGS) <= names
    assert issubclass(obsckpt_errors.SaveTimeoutError, TimeoutError)


def test_a_failed_save_reaches_the_driver_as_save_error(namespace, tmp_path):
    """A rank's wait_all() error, raised in an actor, is a SaveError at ray.get."""
    from workers import SaveWorker

    root = tmp_path / "ckpt"
    monitor = CheckpointMonitor.get_actor(
        namespace=namespace, default_local_dir=root, metrics_port=None
    )
    worker = SaveWorker.remote(namespace, 0)
    ray.get(worker.save.remote(str(root), 1, ["optimizer"], fail_slots=("optimizer",)))
    with pytest.raises(SaveError) as err:
        ray.get(worker.wait_raising.remote(30.0))
    assert (err.value.slot, err.value.step) == ("optimizer", 1)
    assert "No space left on device (injected)" in str(err.value)
    assert not os.path.exists(root / "latest_checkpointed_iteration.txt")
    ray.kill(worker)
    ray.kill(monitor)
