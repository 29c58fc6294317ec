"""obsckpt as a typed library: what a type checker sees of its public API.

obsckpt ships ``py.typed``, so mypy and pyright read its hints in users' code.
These tests check that the names the docs import are exported to a type
checker, that calls written as the docs show them type-check, that misuse is
reported, and that the documented ways to pass values the hints allow work at
run time. The mypy run is skipped where mypy is not installed.
"""

from __future__ import annotations

import ast
import asyncio
import importlib
import inspect
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import obsckpt
from obsckpt import CheckpointMonitor, Synchronizer

PACKAGES = ["obsckpt", "obsckpt.sync", "obsckpt.sync.ipc", "obsckpt.telemetry"]


class TestExports:
    """Every name in a package's ``__all__`` exists, and type checkers can read ``__all__``."""

    @pytest.mark.parametrize("package", PACKAGES)
    def test_every_name_in_all_resolves(self, package: str) -> None:
        module = importlib.import_module(package)
        missing = [name for name in module.__all__ if not hasattr(module, name)]
        assert missing == []

    def test_integrations_all_resolves(self) -> None:
        pytest.importorskip("verl")
        integrations = importlib.import_module("obsckpt.integrations")
        assert [n for n in integrations.__all__ if not hasattr(integrations, n)] == []

    def test_integrations_exports_are_visible_to_type_checkers(self) -> None:
        """``__all__`` is a literal list and each lazy name is imported for type checkers.

        The package imports its submodules on first use (module ``__getattr__``),
        which a type checker reads as ``Any``: without the ``TYPE_CHECKING``
        imports every helper's signature would be invisible in users' code.
        """
        import obsckpt.integrations as integrations

        tree = ast.parse(Path(integrations.__file__).read_text())
        literal_all = None
        checked: dict[str, str] = {}
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
            ):
                literal_all = ast.literal_eval(node.value)
            if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
                for imp in node.body:
                    assert isinstance(imp, ast.ImportFrom)
                    for alias in imp.names:
                        checked[alias.asname or alias.name] = alias.name
        assert literal_all == sorted(integrations._EXPORTS)
        assert sorted(checked) == literal_all
        for name, module in integrations._EXPORTS.items():
            attr = "install" if name == "install_verl" else name
            assert checked[name] == attr, (name, module)


class TestActorHandles:
    """``get_actor`` declares what it returns, so ``handle.method.remote()`` type-checks.

    Without a declared return type pyright infers Ray's ``ActorHandle[T] |
    type[T]`` and reports ``.remote`` as unknown on every documented call.
    """

    @pytest.mark.parametrize("cls", [CheckpointMonitor, Synchronizer])
    def test_return_type_is_declared(self, cls: type) -> None:
        returns = inspect.signature(cls.get_actor).return_annotation
        assert returns is not inspect.Signature.empty
        assert "Returns:" in (inspect.getdoc(cls.get_actor) or "")


class TestMegatronMeta:
    """``megatron_sync_weight_nccl(meta=...)`` takes ``Synchronizer.get_state_dict_meta()``.

    docs/integrations.md suggests that source; it gives ``(name, dtype name,
    shape)`` tuples, which the broadcast used to read as ``TensorMeta`` and
    failed on (``'tuple' object has no attribute 'name'``).
    """

    def test_synchronizer_meta_streams_the_broadcast(self) -> None:
        from obsckpt.integrations.verl_megatron import megatron_sync_weight_nccl
        from obsckpt.sync import WeightSyncGroup, free_port

        weights = {"w": torch.ones(2, 2), "b": torch.zeros(3, dtype=torch.bfloat16)}

        class Engine:
            def get_per_tensor_param(self):
                return iter(weights.items())

        sync = Synchronizer()

        async def published_meta():
            await sync.set_model_state_dict(dict(weights), 1)
            return await sync.get_state_dict_meta()

        meta = asyncio.run(published_meta())
        assert meta == [("w", "float32", (2, 2)), ("b", "bfloat16", (3,))]
        group = WeightSyncGroup(
            host="127.0.0.1", port=free_port(), rank=0, world_size=1, backend="gloo", timeout_s=60
        )
        try:
            result = megatron_sync_weight_nccl(Engine(), group, meta=meta, step=2)
        finally:
            group.close()
        assert result is not None
        assert (result.tensors, result.nbytes) == (2, 2 * 2 * 4 + 3 * 2)

    def test_meta_naming_no_dtype_is_refused_by_name(self) -> None:
        from obsckpt.sync.buckets import as_tensor_meta

        with pytest.raises(ValueError, match="'w': 'floaty' names no torch dtype"):
            as_tensor_meta([("w", "floaty", (2,))])


# What a user writes from README.md and docs/*.md, checked with mypy --strict.
USER_CODE = """
from __future__ import annotations

import enum
import logging
from typing import Any

import ray
import torch

from obsckpt import (
    CheckpointCoordinator,
    CheckpointMonitor,
    SaveStrategy,
    StagedSave,
    Synchronizer,
)
from obsckpt.integrations import (
    FSDPCheckpointManager,
    MegatronCheckpointManager,
    fsdp_save_state_dict,
    fsdp_sync_weight_nccl,
    fsdp_upload_state_dict,
    install_verl,
    megatron_save_state_dict,
    megatron_sync_weight_nccl,
    megatron_upload_state_dict,
    verl_install,
)
from obsckpt.sync import (
    BroadcastResult,
    IpcPayload,
    IpcWeightReceiver,
    IpcWeightSender,
    RankDevice,
    WeightBroadcaster,
    WeightSyncGroup,
    free_port,
    setup_rank_device,
)
from obsckpt.telemetry import Metrics, checkpoint_span, setup_tracing


class TrinityStrategy(enum.Enum):
    UNRESTRICTED = "unrestricted"


def trainer(model: torch.nn.Module, step: int, world: int, rank: int) -> CheckpointCoordinator:
    setup_tracing()
    monitor = CheckpointMonitor.get_actor(
        namespace="job",
        save_strategy=TrinityStrategy.UNRESTRICTED,
        default_local_dir="/ckpt",
        metrics_port=0,
    )
    print("metrics at", ray.get(monitor.metrics_address.remote()))
    coord = CheckpointCoordinator(monitor)
    staged: StagedSave = coord.save_state_dict_async(
        "model", model.state_dict(), f"/ckpt/global_step_{step}/actor/m_{rank}.pt", step,
        is_state_dict=True,
    )
    staged.wait_staged()
    coord.save_async("optim", lambda: None, step, paths=["/ckpt/optim.pt"])
    coord.wait_all()
    print(ray.get(monitor.status.remote()), SaveStrategy.UNRESTRICTED)
    return coord


async def submit(coord: CheckpointCoordinator, step: int, world: int) -> None:
    with checkpoint_span(step) as carrier:
        print(carrier["traceparent"])
        await coord.register_and_monitor(
            step, state_dict_thread_count=world, checkpoint_thread_count=world
        )


def weight_sync(model: torch.nn.Module, addr: str, r: int, step: int) -> None:
    sync = Synchronizer.get_actor(namespace="job", default_local_dir="/ckpt", poll_interval_s=1.0)
    ray.get(sync.set_model_state_dict.remote(model.state_dict(), step))
    version = ray.get(sync.wait_new_model_state_dict.remote(step - 1, timeout=60))
    state_dict, version = ray.get(sync.get_model_state_dict.remote())
    group = WeightSyncGroup(
        host=addr, port=free_port(), rank=r, world_size=2, backend=None, timeout_s=300
    )
    b = WeightBroadcaster(group, bucket_bytes=256 << 20, monitor=None)
    result: BroadcastResult = b.send(model.state_dict(), step=step)
    weights: dict[str, torch.Tensor] = b.recv()
    b.recv(into=dict(model.named_parameters()))
    device: RankDevice = setup_rank_device()
    print(result, weights, device.backend, device.mesh(2), version, state_dict)


def ipc(state: dict[str, torch.Tensor], rollout: Any, payload: IpcPayload, step: int) -> None:
    sender = IpcWeightSender(device=torch.device("cuda", 0))
    sender.send(state, lambda p: rollout.receive_ipc.remote(p), step=step)
    ack, weights = IpcWeightReceiver().recv(payload, into=state)
    print(ack, weights)


def helpers(engine: Any, coord: CheckpointCoordinator, sync: Any, group: WeightSyncGroup) -> None:
    log = logging.getLogger("trainer")
    saved: int = fsdp_save_state_dict(engine, "/ckpt/global_step_1/actor", 1, coord, log)
    seconds: float | None = fsdp_upload_state_dict(engine, sync, 1, log)
    sent: BroadcastResult | None = fsdp_sync_weight_nccl(engine, group)
    saved += megatron_save_state_dict(engine, "/ckpt/global_step_1/actor", 1, coord, log)
    seconds = megatron_upload_state_dict(engine, sync, 1, log)
    meta = ray.get(sync.get_state_dict_meta.remote())
    sent = megatron_sync_weight_nccl(engine, group, meta=meta)
    in_process = Synchronizer()
    print(saved, seconds, sent, in_process, Metrics, FSDPCheckpointManager)
    print(MegatronCheckpointManager, install_verl)
    verl_install.install()
    env: dict[str, Any] = verl_install.runtime_env({"env_vars": {}})
    print(env)
"""

# Misuse a type checker must report (one error per line, each at the line given).
MISUSE = """
from __future__ import annotations

from obsckpt.integrations import fsdp_save_state_dict, megatron_sync_weight_nccl
from obsckpt.sync import setup_rank_device

fsdp_save_state_dict(None, 3, 1, None)  # local_path: str
megatron_sync_weight_nccl(None, None, meta=3)  # meta: an iterable of entries
setup_rank_device(object())  # gpu_ids: a sequence of ids, or None
"""


@pytest.mark.slow
def test_mypy_strict_on_user_code(tmp_path: Path) -> None:
    """The docs' calls type-check with ``mypy --strict``; each misuse is reported.

    One mypy run checks both files (it takes tens of seconds: torch is large).
    """
    pytest.importorskip("mypy", reason="mypy is not installed (the dev extra has it)")
    pytest.importorskip("verl")  # the integrations' managers import it
    (tmp_path / "user_code.py").write_text(USER_CODE)
    (tmp_path / "misuse.py").write_text(MISUSE)
    # The large dependencies' sources are not analysed (their names are Any): the
    # calls checked are obsckpt's, and torch alone takes most of a minute.
    (tmp_path / "mypy.ini").write_text(
        "[mypy]\n[mypy-torch.*,ray.*,verl.*,transformers.*,numpy.*]\nfollow_imports = skip\n"
    )
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--strict",
            "--config-file",
            "mypy.ini",
            "--no-incremental",
            "--cache-dir",
            str(tmp_path / "mypy-cache"),
            "--python-executable",
            sys.executable,
            "user_code.py",
            "misuse.py",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,  # obsckpt is found as installed, py.typed and all
        timeout=600,
    )
    errors = [line for line in done.stdout.splitlines() if ": error:" in line]
    where = sorted((e.split(":")[0], int(e.split(":")[1])) for e in errors)
    assert where == [("misuse.py", 7), ("misuse.py", 8), ("misuse.py", 9)], (
        done.stdout + done.stderr
    )


def test_package_is_typed() -> None:
    assert (Path(obsckpt.__file__).parent / "py.typed").is_file()
