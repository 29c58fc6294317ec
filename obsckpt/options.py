"""The options a user sets: the monitor's, the ``OBSCKPT_*`` variables, actor names.

``MonitorOptions`` is what both ``CheckpointMonitor(...)`` and
``CheckpointMonitor.get_actor(...)`` take (their keywords build one), so its
defaults and checks are written here only. Environment variables are read
with :func:`from_env_if_absent`: the argument, else the variable, else the
default. The job's actors are looked up by name with :func:`lookup_actor`,
which says what to do when the actor is missing.

Importing this module imports neither torch nor Ray.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from obsckpt import validators
from obsckpt.admission import SaveStrategy
from obsckpt.env import (
    OBSCKPT_DEMO_DRIVER,
    OBSCKPT_DIRECT_IO,
    OBSCKPT_EXIT_WAIT_S,
    OBSCKPT_FILE_SD_PATH,
    OBSCKPT_KEEP_STEPS,
    OBSCKPT_LEASE_TIMEOUT_S,
    OBSCKPT_MAX_SLOT_LABELS,
    OBSCKPT_METRICS_HOST,
    OBSCKPT_METRICS_PORT,
    OBSCKPT_MIRROR,
    OBSCKPT_ON_BAD_ITERATION,
    OBSCKPT_SAVE_STRATEGY,
    OBSCKPT_TRACE_EXPORTER,
    OBSCKPT_VERL_COMMIT_TIMEOUT_S,
    from_env_if_absent,
)
from obsckpt.store.uri import is_remote, parse_root, root_or_url
from obsckpt.telemetry.metrics import DEFAULT_MAX_SLOT_LABELS, validate_max_slot_labels
from obsckpt.telemetry.server import validate_port

__all__ = [
    "ACTOR_NAME",
    "DEFAULT_LEASE_TIMEOUT_S",
    "MONITOR_ACTOR_NAME",
    "OBSCKPT_DEMO_DRIVER",
    "OBSCKPT_DIRECT_IO",
    "OBSCKPT_EXIT_WAIT_S",
    "OBSCKPT_FILE_SD_PATH",
    "OBSCKPT_MIRROR",
    "OBSCKPT_VERL_COMMIT_TIMEOUT_S",
    "SYNCHRONIZER_ACTOR_NAME",
    "MonitorOptions",
    "from_env_if_absent",
    "lookup_actor",
]


# Names of the job's actors (one of each per Ray namespace).
MONITOR_ACTOR_NAME = "checkpoint_monitor"
SYNCHRONIZER_ACTOR_NAME = "synchronizer"
ACTOR_NAME = MONITOR_ACTOR_NAME  # the monitor's, as obsckpt.monitor has always exported it

DEFAULT_LEASE_TIMEOUT_S = 120.0
# What a starting monitor does with an iteration file naming a step that is not whole.
ON_BAD_ITERATION = ("refuse", "rewind")


def lookup_actor(
    name: str,
    namespace: str | None = None,
    *,
    hint: str,
    error: type[Exception] = ValueError,
) -> Any:
    """The Ray actor named ``name`` in ``namespace`` (None: the caller's job's).

    Args:
        name: the actor's name (``MONITOR_ACTOR_NAME``, ``SYNCHRONIZER_ACTOR_NAME``).
        namespace: its Ray namespace; None or "" for the current job's.
        hint: what the caller should do when it is missing (appended to the message).
        error: the exception type raised for a missing actor.

    Raises:
        error: no such actor runs there; the message names the actor, the
            namespace and ``hint``.
    """
    import ray

    try:
        return ray.get_actor(name, namespace=namespace or None)
    except ValueError as exc:
        where = f"namespace {namespace!r}" if namespace else "this job's namespace"
        raise error(f"no {name} actor runs in {where}; {hint}") from exc


def _port(text: str) -> int | None:
    return None if text.lower() == "none" else int(text)


def _seconds(text: str) -> float | None:
    return None if text.lower() == "none" else float(text)


def _count(text: str) -> int | None:
    return None if text.lower() == "none" else int(text)


# The options a host's config may set, each with the variable that overrides it.
SETTINGS: dict[str, tuple[str, Callable[[str], Any]]] = {
    "metrics_port": (OBSCKPT_METRICS_PORT, _port),
    "metrics_host": (OBSCKPT_METRICS_HOST, str),
    "save_strategy": (OBSCKPT_SAVE_STRATEGY, str),
    "lease_timeout_s": (OBSCKPT_LEASE_TIMEOUT_S, _seconds),
    "max_slot_labels": (OBSCKPT_MAX_SLOT_LABELS, int),
    "on_bad_iteration": (OBSCKPT_ON_BAD_ITERATION, str),
    "trace_exporter": (OBSCKPT_TRACE_EXPORTER, str),
    "file_sd_path": (OBSCKPT_FILE_SD_PATH, str),
    "mirror": (OBSCKPT_MIRROR, str),
    "keep_steps": (OBSCKPT_KEEP_STEPS, _count),
}


def _refuse_hdfs(default_hdfs_dir: object) -> None:
    if default_hdfs_dir is not None:
        raise ValueError(
            f"default_hdfs_dir={default_hdfs_dir!r} is not supported: obsckpt does not upload "
            "committed steps to remote storage. Pass default_hdfs_dir=None and copy a "
            "global_step_<N> directory once latest_checkpointed_iteration.txt names it"
        )


def _mirror_url(value: object, root: str) -> str | None:
    """``value`` as a mirror: a normalised ``s3://`` URL (or None for an empty one)."""
    if not isinstance(value, (str, os.PathLike)):
        raise ValueError(f"mirror must be an s3://bucket/prefix URL, got {value!r}")
    text = os.fspath(value).strip()
    if not text:
        return None
    parsed = parse_root(text, what="mirror")
    if not parsed.is_remote:
        raise ValueError(
            f"mirror={text!r} is a local path; the mirror is an s3://bucket/prefix URL (for "
            "a second local copy, copy committed steps with your own tools)"
        )
    if is_remote(root):
        raise ValueError(
            f"mirror={text!r} with default_local_dir={root!r}: a root on S3 is committed "
            "there already; a mirror keeps a copy of a local root's steps"
        )
    return str(parsed)


@dataclass(frozen=True, kw_only=True, slots=True)
class MonitorOptions:
    """How a job's :class:`~obsckpt.monitor.CheckpointMonitor` runs.

    Attributes:
        default_local_dir: the checkpoint root holding the iteration files.
        save_strategy: a :class:`SaveStrategy`, its name or value, or another enum
            naming one (e.g. Trinity-RFT's own); stored as a ``SaveStrategy``.
        default_hdfs_dir: must be None: uploading committed steps to remote storage is
            not supported (a ValueError says so rather than ignoring it).
        metrics_port: port for /metrics; 0 picks a free one, None serves nothing.
        metrics_host: interface to bind; a wildcard advertises the node's IP.
        file_sd_path: where to write a Prometheus file_sd JSON naming the endpoint
            (None: the ``OBSCKPT_FILE_SD_PATH`` variable, else none; see
            :meth:`resolved_file_sd_path`).
        namespace: the job's Ray namespace, written as a label into file_sd.
        trace_exporter: exporter name for the monitor's spans (default: ``OTEL_*``
            variables; no tracing unless one of them asks for it).
        lease_timeout_s: a save whose coordinator sends no heartbeat for this long
            (its process died) is failed and its admission released; None never
            expires a save.
        max_slot_labels: distinct slot names kept as the ``slot`` label of the
            metrics; saves of later new slots are recorded as ``slot="_other"``.
        on_bad_iteration: what a starting monitor does when an iteration file names
            a step that is not whole (missing, no manifest, a listed file gone or of
            another size): ``"refuse"`` (the default) fails its start with one line
            saying so; ``"rewind"`` points the file at the latest whole step on disk
            first, as ``obsckpt repair`` does (logged; nothing is deleted).
        trainer_submits: a trainer submits each step once all its managers have
            saved (verl's and Trinity-RFT's switched trainers set it when they create
            the monitor); obsckpt's checkpoint managers then leave submitting to it.
            False: a manager submits the steps it saves itself (used alone; see
            :mod:`obsckpt.integrations.alone`).
        keep_steps: after each commit, remove the committed steps older than the
            newest ``keep_steps`` committed ones (their manifest first, then their
            files or objects); a step an iteration file or the pointer names is never
            removed, nor one newer than the last commit. None: remove nothing. The
            same rule holds on the mirror.
        mirror: an ``s3://bucket/prefix`` that keeps a committed copy of every step
            committed under a local ``default_local_dir`` (:mod:`obsckpt.monitor.mirror`):
            each is copied there after its local commit and committed there as on an
            S3 root, and a monitor starting on a root with no committed step restores
            the mirror's committed steps first. None: no mirror.
    """

    default_local_dir: str
    save_strategy: SaveStrategy = SaveStrategy.UNRESTRICTED
    default_hdfs_dir: str | None = None
    metrics_port: int | None = 0
    metrics_host: str = "0.0.0.0"
    file_sd_path: str | None = None
    namespace: str | None = None
    trace_exporter: str | None = None
    lease_timeout_s: float | None = DEFAULT_LEASE_TIMEOUT_S
    max_slot_labels: int = DEFAULT_MAX_SLOT_LABELS
    on_bad_iteration: str = "refuse"
    trainer_submits: bool = False
    keep_steps: int | None = None
    mirror: str | None = None

    def __post_init__(self) -> None:
        if self.on_bad_iteration not in ON_BAD_ITERATION:
            raise ValueError(
                f"on_bad_iteration must be one of {ON_BAD_ITERATION}, got {self.on_bad_iteration!r}"
            )
        if self.default_local_dir is None:
            raise ValueError("default_local_dir is required: the checkpoint root directory")
        # The strategy and paths are normalised in place: a frozen dataclass allows it here.
        object.__setattr__(self, "save_strategy", SaveStrategy.parse(self.save_strategy))
        object.__setattr__(self, "default_local_dir", root_or_url(self.default_local_dir))
        if self.file_sd_path is not None:
            object.__setattr__(self, "file_sd_path", os.fspath(self.file_sd_path) or None)
        validate_max_slot_labels(self.max_slot_labels)
        keep = self.keep_steps
        if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
            raise ValueError(
                f"keep_steps must be a positive number of committed steps to keep, or None "
                f"to remove none, got {keep!r}"
            )
        lease = self.lease_timeout_s
        if lease is not None and not validators.positive_seconds(lease):
            raise ValueError(f"lease_timeout_s must be positive seconds or None, got {lease!r}")
        _refuse_hdfs(self.default_hdfs_dir)
        validate_port(self.metrics_port)
        if self.mirror is not None:
            object.__setattr__(self, "mirror", _mirror_url(self.mirror, self.default_local_dir))

    @classmethod
    def from_arguments(
        cls,
        save_strategy: SaveStrategy | str | enum.Enum = SaveStrategy.UNRESTRICTED,
        default_local_dir: str | os.PathLike[str] | None = None,
        **fields: Any,
    ) -> MonitorOptions:
        """Options from the monitor's keyword arguments (its constructor's, get_actor's)."""
        return cls(
            save_strategy=save_strategy,  # type: ignore[arg-type]
            default_local_dir=default_local_dir,  # type: ignore[arg-type]
            **fields,
        )

    @classmethod
    def from_settings(
        cls, default_local_dir: str | os.PathLike[str], settings: Any = None, **defaults: Any
    ) -> MonitorOptions:
        """Options for a job switched on from its host's config, the environment winning.

        ``settings`` is a mapping (a Hydra/OmegaConf node such as verl's
        ``+obsckpt.metrics_port=9400``, or a dict) of option names to values;
        each ``OBSCKPT_<NAME>`` variable of :data:`SETTINGS` overrides the
        setting of that name (containers set variables; the config stays as
        written). ``defaults`` are the host integration's own, below both.

        Raises:
            ValueError: a setting that is not an option (naming it and the options),
                or a value an option refuses (naming the setting and where it came from).
        """
        given = dict(settings.items()) if settings is not None else {}
        unknown = sorted(set(given) - set(SETTINGS))
        if unknown:
            raise ValueError(
                f"obsckpt settings {unknown} are not monitor options; the options are "
                f"{sorted(SETTINGS)}"
            )
        fields = {**defaults, **given}
        for name, (variable, parse) in SETTINGS.items():
            raw = os.environ.get(variable)
            if raw:
                try:
                    fields[name] = parse(raw)
                except ValueError as exc:
                    raise ValueError(f"environment variable {variable}={raw!r}: {exc}") from None
        try:
            return cls(default_local_dir=os.fspath(default_local_dir), **fields)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"obsckpt settings {fields}: {exc}") from exc

    def resolved_file_sd_path(self) -> str | None:
        """``file_sd_path``, else ``OBSCKPT_FILE_SD_PATH``, else None."""
        return from_env_if_absent(self.file_sd_path, OBSCKPT_FILE_SD_PATH, None) or None
