"""verl integrations: FSDP and Megatron helpers, checkpoint managers and a one-step install.

Submodules are imported on first use (``from obsckpt.integrations import
fsdp_save_state_dict`` works); importing this package imports neither verl
nor the helpers, so obsckpt's core stays light.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what type checkers see; at run time __getattr__ imports on first use
    from obsckpt.integrations.fsdp_checkpoint_manager import (
        FSDPCheckpointManager as FSDPCheckpointManager,
    )
    from obsckpt.integrations.verl_fsdp import (
        fsdp_save_state_dict as fsdp_save_state_dict,
    )
    from obsckpt.integrations.verl_fsdp import (
        fsdp_sync_weight_nccl as fsdp_sync_weight_nccl,
    )
    from obsckpt.integrations.verl_fsdp import (
        fsdp_upload_state_dict as fsdp_upload_state_dict,
    )
    from obsckpt.integrations.verl_install import install as install_verl
    from obsckpt.integrations.verl_megatron import (
        MegatronCheckpointManager as MegatronCheckpointManager,
    )
    from obsckpt.integrations.verl_megatron import (
        megatron_save_state_dict as megatron_save_state_dict,
    )
    from obsckpt.integrations.verl_megatron import (
        megatron_sync_weight_nccl as megatron_sync_weight_nccl,
    )
    from obsckpt.integrations.verl_megatron import (
        megatron_upload_state_dict as megatron_upload_state_dict,
    )

_EXPORTS = {
    "fsdp_save_state_dict": "obsckpt.integrations.verl_fsdp",
    "fsdp_upload_state_dict": "obsckpt.integrations.verl_fsdp",
    "fsdp_sync_weight_nccl": "obsckpt.integrations.verl_fsdp",
    "megatron_save_state_dict": "obsckpt.integrations.verl_megatron",
    "megatron_upload_state_dict": "obsckpt.integrations.verl_megatron",
    "megatron_sync_weight_nccl": "obsckpt.integrations.verl_megatron",
    "FSDPCheckpointManager": "obsckpt.integrations.fsdp_checkpoint_manager",
    "MegatronCheckpointManager": "obsckpt.integrations.verl_megatron",
    "install_verl": "obsckpt.integrations.verl_install",
}

# A literal list, so that type checkers read it (they do not evaluate sorted(_EXPORTS)).
__all__ = [
    "FSDPCheckpointManager",
    "MegatronCheckpointManager",
    "fsdp_save_state_dict",
    "fsdp_sync_weight_nccl",
    "fsdp_upload_state_dict",
    "install_verl",
    "megatron_save_state_dict",
    "megatron_sync_weight_nccl",
    "megatron_upload_state_dict",
]


def _verl_missing(what: str, exc: ModuleNotFoundError) -> ModuleNotFoundError:
    """The error for ``what`` needing verl when ``exc`` says verl is not installed."""
    return ModuleNotFoundError(
        f"{what} needs verl, which is not installed ({exc}): pip install 'obsckpt[verl]'",
        name=exc.name,
    )


def _is_verl_missing(exc: ModuleNotFoundError) -> bool:
    return (exc.name or "").split(".")[0] == "verl"


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'obsckpt.integrations' has no attribute {name!r}")
    attr = "install" if name == "install_verl" else name
    try:
        value = getattr(importlib.import_module(module), attr)
    except ModuleNotFoundError as exc:
        if _is_verl_missing(exc):
            raise _verl_missing(name, exc) from exc
        raise
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
