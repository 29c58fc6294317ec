"""Delta memory sync: the Synchronizer hands each rollout only what changed since its version.

The trainer publishes whole state dicts (:meth:`Synchronizer.set_model_state_dict`)
as before. When a version replaces one with the same tensors, the Synchronizer
encodes the delta between them once (:mod:`~obsckpt.sync.delta`, in a thread)
and keeps it beside the state. A rollout asks with the version it holds
(:meth:`DeltaMemorySync.get_model_state_dict_update`, or through
:class:`MemorySyncClient`): one that holds the previous version gets the delta
(its plan, with a CRC32 per chunk, and its payload), any other (new, more than
one version behind, or after a failure) the whole state. Every
``full_every``-th version is sent whole to everyone. Each answer carries
CRC32 digests of some tensors of the new version (all of them with a whole
state), which the client compares after applying; it reports the outcome
back (:meth:`DeltaMemorySync.report_update`), which the Synchronizer records
(``method="memory"``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from obsckpt.errors import WeightSyncCorruptError
from obsckpt.sync import delta
from obsckpt.sync.buckets import TensorMeta, tensor_meta
from obsckpt.sync.delta_broadcast import MAX_DELTA_FRACTION

__all__ = ["DeltaMemorySync", "MemorySyncClient"]

logger = logging.getLogger(__name__)

DEFAULT_FULL_EVERY = 20
DEFAULT_DIGEST_TENSORS = 8
_CHUNK_BYTES = 64 << 20


@dataclass(slots=True)
class _Delta:
    base: int
    version: int
    plan: delta.DeltaPlan
    payload: torch.Tensor


def _flat(state: Any) -> bool:
    """Whether ``state`` is a dict of tensors only (what a delta is taken of)."""
    return isinstance(state, dict) and all(isinstance(v, torch.Tensor) for v in state.values())


class DeltaMemorySync:
    """The Synchronizer's delta memory sync (mixed into :class:`~obsckpt.sync.Synchronizer`)."""

    _state_dict: Any
    _version: int | None

    def _init_delta(self, full_every: int = DEFAULT_FULL_EVERY) -> None:
        if isinstance(full_every, bool) or not isinstance(full_every, int) or full_every < 1:
            raise ValueError(f"full_every must be a positive int, got {full_every!r}")
        self.full_every = full_every
        self._delta: _Delta | None = None
        self._encoding: asyncio.Task[_Delta | None] | None = None
        self._since_full = 0
        self._digests: dict[int, dict[int, int]] = {}  # version -> tensor index -> CRC32
        # Versions restart at a resume, so a number alone may name two states: each
        # resume starts a new epoch, and a client of another epoch gets the whole state.
        self.epoch = 0

    def _published(self, old: Any, old_version: int | None, source: str) -> None:
        """A new version is held: encode its delta from ``old`` when that is possible."""
        self._delta, self._digests = None, {}
        if source == "resume":
            self.epoch += 1
        new, version = self._state_dict, self._version
        if (
            source != "memory"
            or not _flat(old)
            or not _flat(new)
            or old_version is None
            or version is None
            or self._since_full + 1 >= self.full_every
            or tensor_meta(old.items()) != tensor_meta(new.items())
        ):
            self._since_full = 0
            self._encoding = None
            return
        self._since_full += 1
        olds, news = list(old.values()), list(new.values())

        def encode() -> _Delta | None:
            try:
                plan, payload = delta.encode_delta(news, olds, chunk_bytes=_CHUNK_BYTES)
            except ValueError as exc:  # a dtype without an integer twin, say
                logger.warning("obsckpt: no delta for step %d, sent whole: %s", version, exc)
                return None
            if plan.nbytes > MAX_DELTA_FRACTION * sum(t.numel() * t.element_size() for t in news):
                return None  # most values moved: whole is as cheap
            return _Delta(old_version, version, plan, payload)

        self._encoding = asyncio.ensure_future(asyncio.to_thread(encode))

    async def get_model_state_dict_update(
        self,
        current_version: int | None = None,
        *,
        epoch: int | None = None,
        digest_tensors: int = DEFAULT_DIGEST_TENSORS,
    ) -> dict[str, Any]:
        """What a rollout holding ``current_version`` (of ``epoch``) needs to hold the latest.

        A client of another epoch (the trainer resumed since, so version numbers
        restarted) is treated as holding nothing. Returns a dict: ``epoch``,
        ``version`` (None: nothing published), ``encoding``
        (``none`` when ``current_version`` is the latest, ``delta``, or
        ``full``), for a delta ``plan`` (its wire form) and ``payload`` (a
        uint8 tensor), for a full one ``state`` (the state dict), and
        ``digests`` (``[(tensor index, CRC32)]``) to check after applying.
        """
        version, state = self._version, self._state_dict
        if epoch is not None and epoch != self.epoch:
            current_version = None
        head = {"epoch": self.epoch, "version": version}
        if version is None or not isinstance(state, dict):
            encoding = "none" if state is None else "full"
            return {**head, "encoding": encoding, "state": state, "digests": []}
        if current_version == version:
            return {**head, "encoding": "none"}
        if not _flat(state):  # nested or not only tensors: sent as it is, unchecked
            return {**head, "encoding": "full", "state": state, "digests": []}
        found = await self._encoded()
        meta = tensor_meta(state.items())
        if found is not None and found.version == version and found.base == current_version:
            picked = delta.digest_indices(meta, version, sample=digest_tensors, full=False)
            return {
                **head,
                "encoding": "delta",
                "base": found.base,
                "plan": found.plan.to_wire(),
                "payload": found.payload,
                "digests": await self._digest(state, version, picked),
                "state_bytes": sum(m.nbytes for m in meta),
            }
        return {
            **head,
            "encoding": "full",
            "state": state,
            "digests": await self._digest(state, version, range(len(meta))),
        }

    async def _encoded(self) -> _Delta | None:
        task = self._encoding
        if task is None:
            return None
        found = await asyncio.shield(task)
        if self._encoding is task:  # not replaced by a newer publish meanwhile
            self._delta = found
        return found

    async def _digest(
        self, state: dict[str, torch.Tensor], version: int, which: Any
    ) -> list[tuple[int, int]]:
        known = self._digests.setdefault(version, {})
        tensors = list(state.values())
        missing = [i for i in which if i not in known]
        if missing:
            crcs = await asyncio.to_thread(lambda: [delta.digest(tensors[i]) for i in missing])
            known.update(zip(missing, crcs, strict=True))
        return [(i, known[i]) for i in which]

    async def report_update(self, report: dict[str, Any]) -> None:
        """A rollout applied (or failed to apply) an update: record it (``method="memory"``)."""
        report = {**report, "method": "memory"}
        self._telemetry().weight_sync(report)  # type: ignore[attr-defined]
        rollout = report.get("rollout_version")
        if report.get("corrupt") is None and rollout is not None:
            self._report_rollout(rollout)  # type: ignore[attr-defined]
        elif report.get("corrupt") is not None:
            logger.warning(
                "obsckpt: a rollout failed the %s check of step %s; it keeps step %s and "
                "asks for the whole state next",
                report["corrupt"],
                report.get("step"),
                rollout,
            )


class MemorySyncClient:
    """The rollout side of the delta memory sync: holds weights, moves them to the latest version.

    Args:
        synchronizer: the :class:`~obsckpt.sync.Synchronizer` actor handle.
        into: tensors to hold the weights in (a model's parameters); default: copies of the
            first state received.
        digest_tensors: tensors compared after each delta (all of them after a whole state).
        timeout: seconds for each call to the synchronizer.
    """

    def __init__(
        self,
        synchronizer: Any,
        *,
        into: dict[str, torch.Tensor] | None = None,
        digest_tensors: int = DEFAULT_DIGEST_TENSORS,
        timeout: float = 300.0,
    ) -> None:
        self.synchronizer = synchronizer
        self.weights: dict[str, torch.Tensor] | None = into
        self._meta: list[TensorMeta] | None = None
        self.version: int | None = None
        self.epoch: int | None = None
        self.weights_valid = True
        self.digest_tensors = digest_tensors
        self.timeout = timeout
        self._want_full = into is not None  # tensors of unknown content: start whole

    def update(self) -> int | None:
        """Fetch and apply what is new; returns the version held now.

        Raises:
            WeightSyncCorruptError: a chunk failed its CRC32 (nothing applied) or a digest
                differed after the apply; the version stays, and the next update is whole.
        """
        import ray

        t0 = time.perf_counter()
        held = None if self._want_full or not self.weights_valid else self.version
        resp = ray.get(
            self.synchronizer.get_model_state_dict_update.remote(
                held, epoch=self.epoch, digest_tensors=self.digest_tensors
            ),
            timeout=self.timeout,
        )
        version, encoding = resp["version"], resp["encoding"]
        if encoding == "none" or version is None:
            return self.version
        phases: dict[str, float] = {}
        t = time.perf_counter()
        report: dict[str, Any] = {"step": version, "encoding": encoding}
        corrupt = None
        with torch.no_grad():
            if encoding == "full":
                self._take_whole(resp["state"])
                report["sent_bytes"] = report["state_bytes"] = sum(
                    m.nbytes for m in self._meta or []
                )
            else:
                plan = delta.DeltaPlan.from_wire(resp["plan"])
                payload = resp["payload"]
                report |= {"sent_bytes": plan.nbytes, "state_bytes": resp["state_bytes"]}
                report["changed_fraction"] = plan.fraction
                corrupt = self._apply(plan, payload)
        phases["apply"] = time.perf_counter() - t
        if corrupt is None:
            t = time.perf_counter()
            corrupt = self._verify(resp["digests"])
            phases["verify"] = time.perf_counter() - t
        if corrupt is None:
            self.version, self.weights_valid, self._want_full = version, True, False
            self.epoch = resp["epoch"]
        else:
            self._want_full = True
        report |= {
            "phases": phases,
            "pause_s": time.perf_counter() - t0,
            "rollout_version": self.version if self.version is not None else -1,
            "corrupt": corrupt,
        }
        self.synchronizer.report_update.remote(report)
        if corrupt is not None:
            raise WeightSyncCorruptError(
                f"the weights of step {version} failed their {corrupt} check"
                + (
                    " (a chunk of the delta did not match its CRC32, nothing was applied)"
                    if corrupt == "checksum"
                    else " after the apply (weights_valid is False)"
                )
                + f"; this rollout keeps step {self.version} and asks for the whole state next"
            )
        return self.version

    def _take_whole(self, state: dict[str, torch.Tensor]) -> None:
        if self.weights is None or set(self.weights) != set(state):
            # The object store's tensors are read-only: hold copies that deltas can update.
            self.weights = {n: t.clone() for n, t in state.items()}
        else:
            for n, t in state.items():
                self.weights[n].copy_(t)
        self._meta = tensor_meta((n, self.weights[n]) for n in state)
        self.weights = {m.name: self.weights[m.name] for m in self._meta}

    def _apply(self, plan: delta.DeltaPlan, payload: torch.Tensor) -> str | None:
        assert self.weights is not None and self._meta is not None
        if delta.check_chunks(payload, plan):
            return "checksum"
        try:
            delta.check_plan(plan, self._meta, payload.numel())
        except ValueError:
            return "checksum"
        self.weights_valid = False
        delta.apply_delta([self.weights[m.name] for m in self._meta], plan, payload)
        self.weights_valid = True
        return None

    def _verify(self, digests: list[tuple[int, int]]) -> str | None:
        assert self.weights is not None and self._meta is not None
        for i, want in digests:
            if delta.digest(self.weights[self._meta[i].name]) != want:
                self.weights_valid = False
                return "digest"
        return None
