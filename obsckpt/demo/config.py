"""The demo's settings, its result and its vocabulary, without torch or Ray.

``obsckpt demo``'s flags are :class:`DemoConfig`'s fields: the command line
takes its choices, defaults and ranges from here, so ``obsckpt --help`` and
``obsckpt status`` run without importing the training stack.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from typing import Any

from obsckpt.admission import SaveStrategy

SYNC_METHODS = ("broadcast", "checkpoint", "ipc", "memory")
DEVICES = ("auto", "cpu", "cuda")
SAVE_STRATEGIES = tuple(s.value for s in SaveStrategy)
DEFAULT_CKPT_DIR = os.path.join("obsckpt-demo", "ckpt")
# Seeds of the synthetic batches are combined with the step into a 64-bit torch seed.
MAX_SEED = 2**32 - 1
# The marker file the demo writes into its checkpoint root: it only uses an empty
# directory or one holding this file (obsckpt.demo.root).
MARKER = "obsckpt-demo.json"

# Exit codes of a run (and of the `obsckpt` command): a signal N that stopped it gives
# 128 + N; a second Ctrl-C that stopped it at once, 130.
EXIT_OK = 0
EXIT_FAILED = 1
EXIT_INTERRUPTED = 130


@dataclass(kw_only=True, slots=True)
class ModelSpec:
    """Shape of the tiny model and of one rank's batch."""

    vocab_size: int = 512
    hidden_size: int = 128
    intermediate_size: int = 256
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    seq_len: int = 32
    batch_size: int = 8

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "seq_len",
            "batch_size",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must divide by num_heads ({self.num_heads}) "
                f"and num_heads by num_kv_heads ({self.num_kv_heads})"
            )


@dataclass(kw_only=True, slots=True)
class DemoConfig:
    """Settings of one demo run (the ``obsckpt demo`` flags)."""

    steps: int = 40
    save_every: int = 10
    world_size: int | None = None  # None: 2 on CPU, 1 on one GPU, a GPU per rank + rollout
    sync_method: str | None = None  # None: broadcast, or ipc on a single GPU
    ckpt_dir: str = DEFAULT_CKPT_DIR
    resume: bool = False
    duration: float | None = None
    metrics_port: int | None = 0
    metrics_host: str = "0.0.0.0"
    file_sd: str | None = None
    otlp_endpoint: str | None = None
    address: str | None = None
    namespace: str | None = None
    save_strategy: str = SaveStrategy.UNRESTRICTED.value
    keep: int = 3
    device: str = "auto"
    seed: int = 0
    lr: float = 1e-2
    progress: bool = True
    verbose: bool = False
    commit_timeout: float = 300.0
    # --kill-at K (or K:save): SIGKILL the job's ranks, rollout and driver at step K
    # (after the step; with kill_in_save, while its checkpoint is being written).
    kill_at: int | None = None
    kill_in_save: bool = False
    # --check-resume REF: the --result-json of an uninterrupted run to compare with.
    check_resume: str | None = None

    def __post_init__(self) -> None:
        for name in ("steps", "keep"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
        for name in ("save_every", "world_size"):
            value = getattr(self, name)
            if name == "world_size" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.sync_method is not None and self.sync_method not in SYNC_METHODS:
            raise ValueError(f"sync_method must be one of {SYNC_METHODS}, got {self.sync_method!r}")
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}")
        if self.duration is not None and not (self.duration > 0 and math.isfinite(self.duration)):
            raise ValueError(
                f"duration must be positive, finite seconds or None, got {self.duration!r}"
            )
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if not 0 <= self.seed <= MAX_SEED:
            raise ValueError(f"seed must be from 0 to {MAX_SEED}, got {self.seed}")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be 0-65535 or None, got {self.metrics_port!r}")
        if not self.lr > 0:
            raise ValueError(f"lr must be positive, got {self.lr!r}")
        if not self.commit_timeout > 0:
            raise ValueError(
                f"commit_timeout must be positive seconds, got {self.commit_timeout!r}"
            )
        if self.kill_at is not None and (
            isinstance(self.kill_at, bool) or not isinstance(self.kill_at, int) or self.kill_at < 1
        ):
            raise ValueError(f"kill_at must be a step number >= 1 or None, got {self.kill_at!r}")
        if self.kill_in_save and (self.kill_at is None or self.kill_at % self.save_every):
            raise ValueError(
                f"kill_in_save needs kill_at to be a step that saves, a multiple of save_every "
                f"({self.save_every}); got kill_at {self.kill_at!r}"
            )


@dataclass(slots=True)
class DemoResult:
    """What a run did, as the tests and the CLI read it."""

    exit_code: int = EXIT_OK
    stop_reason: str = "completed"
    first_step: int = 1
    last_step: int = 0
    resumed_from: int | None = None
    checkpoint_steps: list[int] = field(default_factory=list)
    committed: dict[str, int | None] = field(default_factory=dict)
    rollout_versions: list[int] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    device: str | None = None
    sync_method: str | None = None
    metrics_address: str | None = None
    summary: dict[str, Any] | None = None
    save_errors: list[str] = field(default_factory=list)
    elapsed_s: float = 0.0
    root: str = ""
    # Per step trained, the CRC32 of each rank's batch ("r0,r1"): the data order.
    data_digests: list[str] = field(default_factory=list)
    # CRC32s of the whole training state after the last step (weights, optimizer, ...).
    final_digest: dict[str, str] = field(default_factory=dict)
    # After --resume: the version the trainer published the resumed weights under.
    republished_version: int | None = None
    # --check-resume: "matched ..." or "MISMATCH ...".
    resume_check: str | None = None


# The demo's settings by the flags that set them: DemoConfig's own errors name its fields.
FLAGS = {
    "kill_in_save": "--kill-at K:save",
    "kill_at": "--kill-at",
    "save_every": "--save-every",
    "world_size": "--world-size",
    "sync_method": "--sync-method",
    "metrics_port": "--metrics-port",
    "metrics_host": "--metrics-host",
    "save_strategy": "--save-strategy",
    "otlp_endpoint": "--otlp-endpoint",
    "file_sd": "--file-sd",
    "ckpt_dir": "--ckpt-dir",
    "steps": "--steps",
    "keep": "--keep",
    "device": "--device",
    "seed": "--seed",
    "duration": "--duration",
    "resume": "--resume",
    "address": "--address",
    "namespace": "--namespace",
}


def flag_names(message: str) -> str:
    """``message`` with the demo settings' field names replaced by their flags."""
    pattern = r"\b(" + "|".join(map(re.escape, FLAGS)) + r")\b"
    return re.sub(pattern, lambda m: FLAGS[m.group(1)], message)


def kill_in_save_problem(step: int, every: int) -> str:
    """What ``--kill-at STEP:save`` with ``--save-every EVERY`` asks that cannot be done."""
    return (
        f"--kill-at {step}:save stops the job while step {step}'s checkpoint is written, "
        f"but step {step} saves none with --save-every {every}: name a multiple of "
        f"--save-every (e.g. --kill-at {(step // every + 1) * every}:save), or "
        f"--kill-at {step} to stop it after the step"
    )


# Top-level modules of the ``demo`` extra that the job's processes import.
DEMO_MODULES = ("verl", "transformers", "accelerate")


def missing_demo_modules() -> list[str]:
    """The demo's modules that cannot be found, without importing them (verl takes ~10 s)."""
    import importlib.util

    missing = []
    for name in DEMO_MODULES:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            missing.append(name)
    return missing
