"""The monitor's core on its own: no Ray, no asyncio, no sleeping; a fake clock.

Leases expire when the test advances the clock past ``lease_timeout_s`` and
runs the core's lease check; what the core did is read from the tracker, the
admission queue and a recording observer.
"""

from __future__ import annotations

import pytest

from obsckpt.admission import SaveStrategy
from obsckpt.monitor import CommitRecord, MonitorCore, MonitorObserver
from obsckpt.tickets import Ticket

LEASE_S = 60.0


class FakeClock:
    """Monotonic and wall clocks that move only when the test says."""

    def __init__(self) -> None:
        self.mono = 1000.0
        self.wall = 1_700_000_000.0

    def monotonic(self) -> float:
        return self.mono

    def time(self) -> float:
        return self.wall

    def advance(self, seconds: float) -> None:
        self.mono += seconds
        self.wall += seconds


class Recorder(MonitorObserver):
    """Every event the core reports, as (name, details)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, object]] = []

    def names(self) -> list[str]:
        return [name for name, _ in self.events]

    def save_admitted(self, ticket: Ticket, wait_s: float) -> None:
        self.events.append(("save_admitted", (ticket.ticket, wait_s)))

    def save_released(self, ticket: Ticket) -> None:
        self.events.append(("save_released", ticket.ticket))

    def lease_expired(self, ticket: Ticket, message: str, why: str) -> None:
        self.events.append(("lease_expired", (ticket.ticket, message)))

    def step_failed(self, step: int, kind: str) -> None:
        self.events.append(("step_failed", (step, kind)))

    def step_committed(self, record: CommitRecord) -> None:
        self.events.append(("step_committed", record))


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def observer() -> Recorder:
    return Recorder()


def core_of(clock: FakeClock, observer: Recorder, **kwargs) -> MonitorCore:
    return MonitorCore(
        kwargs.pop("strategy", SaveStrategy.UNRESTRICTED),
        lease_timeout_s=kwargs.pop("lease_timeout_s", LEASE_S),
        observer=observer,
        clock=clock,
        **kwargs,
    )


def start(core: MonitorCore, step: int = 1, *, slot: str = "model", lease: bool = True) -> Ticket:
    """A leased save of ``step``, admitted (it must be: the strategy lets it run)."""
    ticket = core.start(
        node_id="n",
        step=step,
        slot=slot,
        kind="checkpoint",
        rank=0,
        pid=42,
        carrier=None,
        lease=lease,
        part=None,
        parts=None,
        unless_closed=False,
    )
    assert ticket is not None
    assert core.request_admission(ticket, "job", lambda: None)
    core.admitted(ticket)
    return ticket


def finished_ok(core: MonitorCore, ticket: Ticket, **measured: float) -> None:
    """``ticket``'s save of step 1 (slot ``model``, rank 0) finished ok."""
    core.finish(
        1,
        "checkpoint",
        ticket=ticket.ticket,
        slot="model",
        rank=0,
        ok=True,
        error=None,
        duration_s=measured.get("duration_s"),
        nbytes=measured.get("nbytes"),
        join_wait_s=None,
        files=None,
        part=None,
        parts=None,
        admitted=True,
    )


class TestLeaseExpiry:
    """A leased save with no heartbeat for longer than lease_timeout_s is failed, its
    admission released and its step failed; one that renews its lease is left alone."""

    def test_a_silent_save_expires_once_the_clock_passes_its_lease(self, clock, observer):
        core = core_of(clock, observer, strategy=SaveStrategy.SINGLE_THREAD)
        core.register(1, checkpoint_count=1)
        ticket = start(core)
        clock.advance(LEASE_S)  # exactly the lease: not yet past it
        assert core.expire_stale_leases() == []

        clock.advance(1.0)
        [expired] = core.expire_stale_leases()

        assert expired.ticket == ticket.ticket
        assert not core.tickets and core.admission.running == {}
        [(step, kind, record)] = core.tracker.failed()
        assert (step, kind) == (1, "checkpoint")
        assert "sent no heartbeat for 61 s" in record.error
        assert observer.names() == [
            "save_admitted",
            "save_released",
            "lease_expired",
            "step_failed",
        ]
        # The released admission lets the next save run at once.
        assert start(core, 2).admitted == clock.mono

    def test_heartbeats_keep_a_save_alive(self, clock, observer):
        core = core_of(clock, observer)
        core.register(1, checkpoint_count=1)
        ticket = start(core)
        for _ in range(5):
            clock.advance(LEASE_S * 0.75)
            core.heartbeat([ticket.ticket])
            assert core.expire_stale_leases() == []
        assert [t.ticket for t in core.tickets] == [ticket.ticket]
        assert core.tracker.failed() == []

    def test_a_gap_in_the_monitor_itself_expires_nothing(self, clock, observer):
        core = core_of(clock, observer)
        core.register(1, checkpoint_count=1)
        start(core)
        clock.advance(10 * LEASE_S)  # the monitor's process was stopped
        core.renew_all_leases()
        assert core.expire_stale_leases() == []

    def test_an_unleased_save_never_expires(self, clock, observer):
        core = core_of(clock, observer)
        core.register(1, checkpoint_count=1)
        start(core, lease=False)
        clock.advance(100 * LEASE_S)
        assert core.expire_stale_leases() == []
        assert not core.watched()

    def test_a_finish_after_expiry_is_ignored_and_the_step_stays_failed(self, clock, observer):
        core = core_of(clock, observer)
        core.register(1, checkpoint_count=1)
        core.submit(1, "checkpoint")
        ticket = start(core)
        clock.advance(LEASE_S + 1)
        core.expire_stale_leases()
        finished_ok(core, ticket, duration_s=1.0, nbytes=10)
        assert core.begin_next_commit() is None
        assert [(s, k) for s, k, _ in core.tracker.failed()] == [(1, "checkpoint")]

    def test_saves_on_a_dead_node_expire(self, clock, observer):
        core = core_of(clock, observer, lease_timeout_s=None, watch_nodes=True)
        core.register(1, checkpoint_count=1)
        ticket = start(core, lease=False)
        assert core.watched()
        [expired] = core.expire_on_nodes({"n"})
        assert expired.ticket == ticket.ticket
        assert "runs on a node that Ray reports dead" in core.tracker.failed()[0][2].error


class TestCommitTimes:
    """A commit's times are the clock's; status shows them in the wall clock of now."""

    def test_commit_record_and_lag(self, clock, observer):
        core = core_of(clock, observer)
        core.register(1, checkpoint_count=1)
        ticket = start(core)
        clock.advance(5.0)
        finished_ok(core, ticket)
        core.submit(1, "checkpoint")
        job = core.begin_next_commit()
        assert job is not None and (job.step, job.kind, job.saves) == (1, "checkpoint", 1)
        clock.advance(2.0)
        record = core.commit_done(job, {"fsync": 1.5})
        assert record.moved == ("checkpoint", "state_dict")
        assert record.committed_at - record.started_at == 7.0
        assert core.tracker.latest == {"checkpoint": 1, "state_dict": 1}
        assert core.unix(core.last_commit["checkpoint"]) == clock.wall
        assert observer.events[-1] == ("step_committed", record)


class TestSettled:
    """A step is settled (its unlisted files are strays) only once no save of it holds a
    ticket, none of its kinds waits for saves, and no commit of it is listing its files."""

    def test_a_step_settles_after_its_commit(self, clock, observer):
        core = core_of(clock, observer)
        core.register(1, checkpoint_count=1)
        assert not core.settled(1)  # registered saves are on their way
        ticket = start(core)
        assert not core.settled(1)
        finished_ok(core, ticket)
        core.submit(1, "checkpoint")
        job = core.begin_next_commit()
        assert job is not None
        assert core.committing(1) and not core.settled(1)
        core.commit_done(job, {})
        assert not core.committing(1) and core.settled(1)
        start(core, 1, slot="late")  # a re-save of the committed step holds a ticket
        assert not core.settled(1)

    def test_an_open_kind_keeps_its_step_unsettled(self, clock, observer):
        core = core_of(clock, observer)
        core.register(2, state_dict_count=1)
        assert not core.settled(2)
        assert core.settled(3)  # nothing known of it


class TestRefusedReport:
    """A report naming a file outside its step is refused only after it is counted as a
    failure: its admission is released, its step failed, and nothing stays in flight."""

    @pytest.mark.parametrize("path", ["/elsewhere/global_step_4/m.pt", "../global_step_4/m.pt"])
    def test_the_save_is_released_and_its_step_failed_before_the_refusal(
        self, clock, observer, path
    ):
        from obsckpt.errors import NotificationError

        core = core_of(clock, observer, strategy=SaveStrategy.SINGLE_THREAD)
        core.register(5, checkpoint_count=1)
        core.submit(5, "checkpoint")
        ticket = start(core, 5)
        with pytest.raises(NotificationError, match=r"save 'model' of step 5 reported a file"):
            core.finish(
                5,
                "checkpoint",
                ticket=ticket.ticket,
                slot="model",
                rank=0,
                ok=True,
                error=None,
                duration_s=1.0,
                nbytes=1,
                join_wait_s=None,
                files=[{"path": path, "size": 1, "crc32": "00000000"}],
                part=None,
                parts=None,
                admitted=True,
            )
        assert not core.tickets and core.admission.running == {}
        assert core.tracker.pending() == []
        [(step, kind, record)] = core.tracker.failed()
        assert (step, kind, record.in_flight) == (5, "checkpoint", 0)
        assert "outside the step directory" in record.error
        # The single-thread strategy admits the next save at once: nothing holds it.
        assert start(core, 6).admitted == clock.mono
