"""The weight-sync group: a process group of its own between trainer rank 0 and the receivers.

:class:`WeightSyncGroup` is a *stateless* process group: a ``TCPStore`` plus a
``ProcessGroupGloo`` (CPU) or ``ProcessGroupNCCL`` (CUDA) built directly on it.
It is never registered with ``torch.distributed``'s global state, so it can be
created in Ray actors that already run a default process group (the FSDP or
Megatron trainer ranks, a vLLM engine) without touching it, and it can be
created again after it breaks. It forms only once every member has checked
in; its collectives are called on the backend object, with every wait
bounded by a deadline, and a collective that fails or outlasts it breaks the
group (its communicator aborted at once).
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import socket
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from obsckpt.errors import BroadcastError, BroadcastTimeoutError
from obsckpt.sync.bounded import ABORT_JOIN_S, leave_behind, poll_completed, run_bounded
from obsckpt.telemetry.metrics import BROADCAST_BACKENDS

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 300.0


# Ports picked for a store lie above Ray's worker ports (10002-19999 unless set
# otherwise) and below the kernel's ephemeral range.
_PICK_LOW = 20000
_RANDOM = random.Random()


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (32768 where it cannot be read)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago, for a group's store.

    Picked at random below the kernel's ephemeral range: a port the kernel hands
    out (binding port 0) is the kind it gives the next outgoing connection's local
    end, which then takes it before the store binds it (``EADDRINUSE``). Falls back
    to the kernel's choice where that range leaves too little room.
    """
    high = _ephemeral_low() - 1
    if high - _PICK_LOW >= 1000:
        for _ in range(64):
            port = _RANDOM.randint(_PICK_LOW, high)
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                try:
                    s.bind((host, port))
                except OSError:
                    continue
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        chosen: int = s.getsockname()[1]
        return chosen


def default_backend() -> str:
    """``nccl`` when CUDA and NCCL are present, else ``gloo``."""
    if torch.cuda.is_available() and dist.is_nccl_available():
        return "nccl"
    return "gloo"


class WeightSyncGroup:
    """A process group of its own between trainer rank 0 (rank ``src``) and the receivers.

    Every member constructs it with the same ``host``, ``port`` and
    ``world_size``; rank 0 hosts the store. Construction returns only once
    every member has checked in and the communicator has carried one
    collective, on every backend: each member sets its key in the group's
    store and waits for all the others' (a missing member is named in the
    :class:`BroadcastTimeoutError`), then the communicator is made (NCCL's
    eagerly, for this member's device) and a one-element broadcast goes
    through it, all within ``timeout_s``.

    A collective that fails or outlasts its deadline breaks the group: its
    communicator is aborted at once (NCCL's error handling is set to clean
    up the communicator without ending the process), every later use raises
    :class:`BroadcastError`, and the members form a new group on a fresh port.

    Args:
        host: address of rank 0's store, reachable by every member.
        port: the store's port (see :func:`free_port`).
        rank: this member's rank in the group (0 for the trainer).
        world_size: number of members (1 + receivers).
        backend: ``gloo`` or ``nccl``; default ``nccl`` with CUDA, else ``gloo``.
        timeout_s: bound on the formation and default bound on each broadcast.
        group_name: prefix of the group's keys in the store.
        device: the CUDA device for ``nccl`` (default: the current device).
    """

    def __init__(
        self,
        *,
        host: str,
        port: int,
        rank: int,
        world_size: int,
        backend: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        group_name: str = "obsckpt-weight-sync",
        device: torch.device | int | None = None,
    ) -> None:
        backend = backend or default_backend()
        if backend not in BROADCAST_BACKENDS:
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
        if world_size < 1:
            raise ValueError(f"world_size must be at least 1, got {world_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive seconds, got {timeout_s!r}")
        self.host, self.port = host, int(port)
        self.rank, self.world_size = rank, world_size
        self.backend = backend
        self.timeout_s = float(timeout_s)
        self._broken: str | None = None
        self._closed = False
        self._pg: Any = None
        self._store: Any = None
        self._abort_thread: threading.Thread | None = None
        if backend == "gloo":
            self.device = torch.device("cpu")
        else:
            if not torch.cuda.is_available():
                raise BroadcastError(
                    "backend 'nccl' needs a CUDA device and none is visible to this process; "
                    "use backend='gloo' on CPU"
                )
            index = device.index if isinstance(device, torch.device) else device
            self.device = torch.device(
                "cuda", torch.cuda.current_device() if index is None else int(index)
            )
        t0 = time.monotonic()
        deadline = t0 + self.timeout_s
        where = f"weight-sync group {host}:{self.port} (rank {rank} of {world_size}, {backend})"
        # No local keeps the store: a failed formation must not hold rank 0's port.
        self._store = dist.PrefixStore(
            group_name, _open_store(host, self.port, rank, world_size, self.timeout_s, t0, where)
        )
        try:
            self._rendezvous(deadline, where)
            self._pg = self._connect(deadline, where)
            self._warm_up(deadline, where)
        except BaseException as exc:
            self._closed = True
            self._release(("abort", "shutdown"))
            self._join_abort()
            self._store = None
            # The traceback's frames hold the store too (a caller keeping the error
            # would keep the port): let go of their locals.
            seen: BaseException | None = exc
            while seen is not None:
                traceback.clear_frames(seen.__traceback__)
                seen = seen.__cause__ or seen.__context__
            raise

    # -- formation -------------------------------------------------------

    def _rendezvous(self, deadline: float, where: str) -> None:
        """Every member sets its key and waits for everyone's; names who did not come.

        Members poll the store rather than block in one wait, so each knows
        who was still missing even if rank 0 (the store's host) gives up first.
        """
        store = self._store
        keys = [f"arrived/{r}" for r in range(self.world_size)]
        store.set(keys[self.rank], str(time.time()))
        missing = [r for r in range(self.world_size) if r != self.rank]
        pause = 0.005
        try:
            while True:
                if store.check(keys):
                    return
                missing = [r for r, k in enumerate(keys) if not store.check([k])]
                if not missing:
                    return
                if time.monotonic() >= deadline:
                    break
                time.sleep(min(pause, max(deadline - time.monotonic(), 0)))
                pause = min(pause * 2, 0.1)
            cause = None
        except (RuntimeError, dist.DistStoreError) as exc:
            cause = exc  # the store went away: rank 0 gave up or died
        who = f"ranks {missing} did not arrive"
        if cause is not None:
            who += f" before rank 0's store closed ({cause})"
        raise BroadcastTimeoutError(
            f"{where} could not form within {self.timeout_s:.1f} s: {who}. Start every member "
            "with the same host, port and world_size, or create the group again on a fresh port"
        ) from cause

    def _connect(self, deadline: float, where: str) -> Any:
        """Make the backend within what is left of the deadline; name the members that held it up.

        Gloo connects every pair inside its constructor, waiting for each
        member's address in the store: a member that checked in and then
        stalled would hold it for a whole timeout of its own.
        """
        store = self._store
        made: list[Any] = []

        def make() -> None:
            store.set(f"connecting/{self.rank}", "1")
            pg = _make_backend(
                self.backend, store, self.rank, self.world_size, self.timeout_s, deadline
            )
            store.set(f"made/{self.rank}", "1")
            made.append(pg)

        try:
            run_bounded(
                make,
                deadline,
                lambda: None,  # left behind, the constructor ends by the same deadline
                f"{where} could not form within {self.timeout_s:.1f} s: the communicator "
                "was not made",
                grace=1.0 if self.backend == "gloo" else 0.0,  # gloo's own timeout is the deadline
            )
        except BroadcastError as exc:
            # The constructor's own timeout and the deadline are the same instant.
            late = time.monotonic() >= deadline - 0.1 or "timed out" in str(exc).lower()
            cls = BroadcastTimeoutError if isinstance(exc, TimeoutError) or late else BroadcastError
            raise cls(f"{exc}{self._laggards()}") from exc.__cause__
        return made[0]

    def _laggards(self) -> str:
        return _who_held_up(self._store, self.rank, self.world_size)

    def _warm_up(self, deadline: float, where: str) -> None:
        """Make the communicator now and pass one collective through it, within the deadline."""
        probe = torch.ones(1, dtype=torch.int64, device=self.device)

        def connect() -> None:
            if self.backend == "nccl":
                torch.cuda.set_device(self.device)  # the current device is per thread
                eager = getattr(self._pg, "eager_connect_single_device", None)
                if eager is not None:
                    eager(self.device)
            self.wait(
                self.broadcast_async(probe, 0, deadline),
                deadline,
                lambda timed_out: (
                    f"{where}: the first collective "
                    + ("did not complete" if timed_out else "failed")
                ),
            )

        try:
            run_bounded(
                connect,
                deadline,
                self._abort,
                f"{where} could not form within "
                f"{self.timeout_s:.1f} s: the communicator did not connect every member",
            )
        except BroadcastError as exc:
            self._abort()
            self._join_abort()
            raise type(exc)(f"{exc}{self._laggards()}") from exc.__cause__

    # -- use -------------------------------------------------------------

    def __repr__(self) -> str:
        state = f"broken: {self._broken}" if self._broken else "ok"
        return (
            f"WeightSyncGroup({self.host}:{self.port}, rank={self.rank}, "
            f"world_size={self.world_size}, backend={self.backend}, {state})"
        )

    @property
    def broken(self) -> str | None:
        """Why the group can no longer be used, or None."""
        return self._broken

    def mark_broken(self, reason: str) -> None:
        """Mark the group broken (the peers are out of step) and abort its communicator.

        Every later use raises :class:`BroadcastError` naming ``reason`` (the
        first one given); collectives blocked on the group fail here and on the peers.
        """
        if self._broken is None:
            self._broken = reason
            logger.error(
                "obsckpt: weight-sync group %s:%d broken: %s", self.host, self.port, reason
            )
            self._abort()

    def deadline(self, timeout_s: float | None = None) -> float:
        """Monotonic time ``timeout_s`` seconds from now (default: the group's ``timeout_s``)."""
        return time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)

    def broadcast_async(
        self, tensor: torch.Tensor, src: int = 0, deadline: float | None = None
    ) -> Any:
        """Start broadcasting ``tensor`` from ``src``; returns the work handle.

        With ``deadline`` (monotonic seconds) the collective itself times out
        then, so nothing of it outlives the caller's bound. The tensor must be
        contiguous; it travels as its bytes, so every dtype does (gloo refuses
        float8 and unsigned types wider than a byte, and would break the group).
        """
        self._check()
        if not tensor.is_contiguous():
            raise ValueError(
                f"broadcast needs a contiguous tensor, got one of shape {tuple(tensor.shape)} "
                f"and strides {tensor.stride()}; pass tensor.contiguous() (and copy it back)"
            )
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        budget = self.timeout_s if deadline is None else deadline - time.monotonic()
        opts.timeout = timedelta(seconds=max(budget, 0.001))
        wire = tensor.reshape(-1).view(torch.uint8)  # a view: received bytes land in ``tensor``
        try:
            return self._pg.broadcast([wire], opts)
        except RuntimeError as exc:
            self.mark_broken(f"broadcast could not start: {exc}")
            raise BroadcastError(f"{self!r}: {exc}") from exc

    def min_async(self, tensor: torch.Tensor, deadline: float) -> Any:
        """Start an element-wise minimum of ``tensor`` over every member (int64, in place).

        The delta sync (:mod:`~obsckpt.sync.delta_broadcast`) agrees on the
        base version and gathers the receivers' results with it.
        """
        self._check()
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN  # type: ignore[assignment] # the stubs want a ReduceOp
        opts.timeout = timedelta(seconds=max(deadline - time.monotonic(), 0.001))
        try:
            return self._pg.allreduce([tensor], opts)
        except RuntimeError as exc:
            self.mark_broken(f"all-reduce could not start: {exc}")
            raise BroadcastError(f"{self!r}: {exc}") from exc

    def wait(self, work: Any, deadline: float, progress: Callable[[bool], str]) -> None:
        """Wait for ``work`` until ``deadline`` (monotonic seconds); raise with ``progress`` on failure.

        ``progress(timed_out)`` describes the failure: a collective that ran
        out of time, or one that failed (a peer gone, a type gloo refuses).
        On NCCL, ``work.wait()`` only orders streams, so completion is polled
        on the CPU against the deadline; a collective that does not complete
        in time aborts the communicator, which ends it on every member.
        """
        try:
            if self.backend == "nccl":
                ok = poll_completed(work, deadline)
                if ok:
                    work.wait()  # raises the collective's error, if it had one
            else:
                remaining = max(deadline - time.monotonic(), 0.001)
                ok = work.wait(timedelta(seconds=remaining))
        except RuntimeError as exc:
            timed_out = time.monotonic() >= deadline - 0.01 or "timed out" in str(exc).lower()
            self.mark_broken(str(exc))
            cls = BroadcastTimeoutError if timed_out else BroadcastError
            raise cls(f"{progress(timed_out)}: {exc}") from exc
        if ok is False:
            self.mark_broken("wait timed out")
            raise BroadcastTimeoutError(progress(True))

    def broadcast(
        self, tensor: torch.Tensor, src: int = 0, *, timeout_s: float | None = None
    ) -> None:
        """Broadcast one tensor from ``src`` and wait for it (bounded)."""
        deadline = self.deadline(timeout_s)
        work = self.broadcast_async(tensor, src, deadline)
        self.wait(
            work,
            deadline,
            lambda timed_out: (
                f"broadcast of {tensor.numel() * tensor.element_size()} bytes on "
                f"{self!r} {'did not finish in time' if timed_out else 'failed'}"
            ),
        )

    def close(self) -> None:
        """Release the group; collectives still in flight fail on the peers.

        A broken group's abort runs on a helper thread: close() waits for it
        (at most ``ABORT_JOIN_S``), so nothing of the group outlives it.
        """
        if self._broken is None:
            self._broken = "closed"
            self._release(("shutdown", "abort"))
        elif self._broken != "closed" and self._abort_thread is None:
            self._abort()
        self._join_abort()
        self._closed = True
        # Rank 0 hosts the store: its listening port and thread live as long as the
        # store does, so drop it now rather than when this object is collected.
        self._store = None

    def _join_abort(self) -> None:
        t = self._abort_thread
        if t is None:
            return
        t.join(ABORT_JOIN_S)
        if t.is_alive():
            logger.warning(
                "obsckpt: the abort of weight-sync group %s:%d is still running after %.0f s",
                self.host,
                self.port,
                ABORT_JOIN_S,
            )
        else:
            self._abort_thread = None

    def _release(self, methods: tuple[str, ...]) -> None:
        pg, self._pg = self._pg, None
        if pg is None:
            return
        for method in methods:
            fn = getattr(pg, method, None)
            if fn is None:
                continue
            try:
                fn()
                break
            except Exception:  # noqa: BLE001 - best effort on a dead group
                continue

    def _abort(self) -> None:
        """End the communicator now: collectives blocked on it fail here and on the peers.

        NCCL's abort returns at once. Gloo's may wait for the collective in
        flight, which ends by its own deadline: it runs on a helper thread,
        which close() and the interpreter's exit join (bounded), since a
        process that exits while it is inside the abort dies of SIGABRT.
        """
        if self.backend == "nccl":
            self._release(("abort", "shutdown"))
            return
        if self._abort_thread is not None and self._abort_thread.is_alive():
            return
        t = threading.Thread(
            target=self._release,
            args=(("abort", "shutdown"),),
            name="obsckpt-weight-sync-abort",
            daemon=True,
        )
        self._abort_thread = t
        t.start()
        leave_behind(t)

    def _check(self) -> None:
        if self._closed:
            raise BroadcastError(
                f"{self!r} was closed; create a new group (on a fresh port, see free_port) "
                "on every member to sync again"
            )
        if self._broken is not None:
            raise BroadcastError(
                f"{self!r} cannot be used: {self._broken}; close it and create a new group "
                "with a fresh port on every member"
            )


def _open_store(
    host: str, port: int, rank: int, world_size: int, timeout_s: float, t0: float, where: str
) -> Any:
    """The group's ``TCPStore``: rank 0 hosts it, the others reach it by ``t0 + timeout_s``."""
    made: list[Any] = []

    def connect() -> None:
        made.append(
            dist.TCPStore(
                host,
                port,
                world_size,
                rank == 0,
                timedelta(seconds=timeout_s),
                wait_for_workers=False,
            )
        )

    try:
        # The client retries its connection past its timeout; keep the deadline.
        run_bounded(connect, t0 + timeout_s, lambda: None, "the store did not answer in time")
    except BroadcastError as exc:
        waited = time.monotonic() - t0
        if rank == 0:
            msg = (
                f"{where} could not host its store at {host}:{port} ({exc}); "
                "create the group on a free port (see free_port)"
            )
        else:
            msg = (
                f"{where} could not form after {waited:.1f} s: rank 0's store at "
                f"{host}:{port} was not reachable ({exc}). Check that every member "
                "was started with the same host, port and world_size and can reach rank 0"
            )
        if isinstance(exc, TimeoutError) or "timed out" in str(exc).lower():
            raise BroadcastTimeoutError(msg) from exc
        raise BroadcastError(msg) from exc
    return made.pop()


def _make_backend(
    backend: str, store: Any, rank: int, world_size: int, timeout_s: float, deadline: float
) -> Any:
    """The group's backend object, built on its store (gloo's connects every pair here)."""
    if backend == "gloo":
        remaining = timedelta(seconds=max(deadline - time.monotonic(), 0.001))
        pg = dist.ProcessGroupGloo(store, rank, world_size, remaining)
        # Collectives get their own deadline; the default is the group's timeout.
        set_default = getattr(pg, "_set_default_timeout", None)
        if set_default is not None:
            set_default(timedelta(seconds=timeout_s))
        return pg
    timeout = timedelta(seconds=timeout_s)
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    # Read when the group is made: on a failure NCCL's watchdog aborts this
    # communicator only, instead of ending the whole trainer process.
    with _env(TORCH_NCCL_ASYNC_ERROR_HANDLING="2"):
        return dist.ProcessGroupNCCL(store, rank, world_size, opts)


def _who_held_up(store: Any, rank: int, world_size: int) -> str:
    """Which members held the formation up, for its error message (best effort, <= 1 s).

    Asked aside: a rank 0 that stalled would hold the store's answers too.
    """
    others = [r for r in range(world_size) if r != rank]
    found: list[tuple[list[int], list[int]]] = []

    def ask() -> None:
        idle = [r for r in others if not store.check([f"connecting/{r}"])]
        slow = [r for r in others if not store.check([f"made/{r}"])]
        found.append((idle, slow))

    try:
        run_bounded(ask, time.monotonic() + 1.0, lambda: None, "the store did not answer")
    except BroadcastError:  # the store is gone with rank 0, or stalled with it
        return ""
    idle, slow = found[0]
    if idle:
        return (
            f"; ranks {idle} checked in but never started making it (stalled or died "
            "since): restart them and form the group again on a fresh port"
        )
    if slow:
        return (
            f"; ranks {slow} did not finish making it: check that every member can "
            "reach the others' addresses"
        )
    return ""


@contextlib.contextmanager
def _env(**values: str) -> Iterator[None]:
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
