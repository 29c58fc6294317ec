"""The commit state machine, without Ray: examples for each rule and a randomised search."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from obsckpt.errors import NotificationError
from obsckpt.tracker import (
    ABANDONED,
    COMMITTED,
    COMMITTING,
    FAILED,
    SUPERSEDED,
    CommitTracker,
)


def commit_ready(t: CommitTracker) -> list[tuple[int, str]]:
    """What the monitor does: commit everything ready, in order, until nothing is."""
    done = []
    while ready := t.ready():
        for step, kind in ready:
            t.begin_commit(step, kind)
            t.end_commit(step, kind, ok=True)
            done.append((step, kind))
    return done


class TestCommitRule:
    """A step commits once submitted, every registered save finished, none failed."""

    def test_full_checkpoint_waits_for_every_save_of_both_kinds(self):
        t = CommitTracker()
        t.register(5, state_dict_count=2, checkpoint_count=2)
        for _ in range(2):
            t.start(5, "state_dict")
            t.start(5, "checkpoint")
        t.submit(5, "checkpoint")
        t.finish(5, "checkpoint")
        t.finish(5, "checkpoint")
        t.finish(5, "state_dict")
        assert commit_ready(t) == []
        t.finish(5, "state_dict")
        assert commit_ready(t) == [(5, "checkpoint")]
        # Committing a full checkpoint also commits its state dict.
        assert t.latest == {"checkpoint": 5, "state_dict": 5}

    def test_finish_before_registration_is_fine(self):
        t = CommitTracker()
        t.start(1, "state_dict")
        t.finish(1, "state_dict")
        t.register(1, state_dict_count=1)
        assert commit_ready(t) == []  # not submitted yet
        t.submit(1, "state_dict")
        assert commit_ready(t) == [(1, "state_dict")]
        assert t.latest == {"checkpoint": None, "state_dict": 1}

    def test_in_flight_save_blocks_commit_even_if_counts_balance(self):
        t = CommitTracker()
        t.start(3, "state_dict")
        t.submit(3, "state_dict")  # nothing registered, but a save is running
        assert commit_ready(t) == []
        t.register(3, state_dict_count=1)
        t.finish(3, "state_dict")
        assert commit_ready(t) == [(3, "state_dict")]


class TestFailures:
    """A failed save fails its step, which never commits; later steps still do."""

    def test_failed_step_never_commits_and_later_step_does(self):
        t = CommitTracker()
        t.register(1, checkpoint_count=2)
        t.start(1, "checkpoint")
        t.start(1, "checkpoint")
        assert t.finish(1, "checkpoint", ok=False, error="disk full") == [(1, "checkpoint")]
        t.finish(1, "checkpoint")
        t.submit(1, "checkpoint")
        assert commit_ready(t) == []
        assert [(s, k) for s, k, _ in t.failed()] == [(1, "checkpoint")]
        t.register(2, checkpoint_count=1)
        t.start(2, "checkpoint")
        t.finish(2, "checkpoint")
        t.submit(2, "checkpoint")
        assert commit_ready(t) == [(2, "checkpoint")]

    def test_state_dict_failure_fails_the_full_checkpoint_of_that_step(self):
        t = CommitTracker()
        t.register(4, state_dict_count=1, checkpoint_count=1)
        t.start(4, "state_dict")
        t.start(4, "checkpoint")
        t.finish(4, "checkpoint")
        failed = t.finish(4, "state_dict", ok=False, error="boom")
        assert (4, "state_dict") in failed and (4, "checkpoint") in failed
        t.submit(4, "checkpoint")
        assert commit_ready(t) == []
        assert t.latest["checkpoint"] is None

    def test_more_finishes_than_registrations_is_an_error_that_fails_the_step(self):
        t = CommitTracker()
        t.register(2, checkpoint_count=1)
        t.finish(2, "checkpoint")
        t.finish(2, "checkpoint")
        with pytest.raises(NotificationError, match=r"2 saves finished but only 1 were registered"):
            t.submit(2, "checkpoint")
        assert t.progress(2, "checkpoint").state == FAILED

    def test_failed_commit_io_fails_the_step(self):
        t = CommitTracker()
        t.submit(7, "state_dict")
        [(step, kind)] = t.ready()
        t.begin_commit(step, kind)
        t.end_commit(step, kind, ok=False, error="EIO")
        assert t.progress(7, "state_dict").state == FAILED
        assert t.latest["state_dict"] is None


class TestOrder:
    """The committed step never goes backwards; bad steps are refused with the value named."""

    def test_out_of_order_completion_closes_the_older_step(self):
        t = CommitTracker()
        for step in (10, 20):
            t.register(step, checkpoint_count=1)
            t.start(step, "checkpoint")
            t.submit(step, "checkpoint")
        t.finish(20, "checkpoint")
        assert commit_ready(t) == [(20, "checkpoint")]
        assert t.progress(10, "checkpoint").state == ABANDONED
        t.finish(10, "checkpoint")
        assert commit_ready(t) == []
        assert t.progress(10, "checkpoint").state == ABANDONED
        assert t.latest["checkpoint"] == 20

    def test_registering_a_closed_step_is_a_logged_no_op(self):
        t = CommitTracker()
        t.submit(20, "state_dict")
        assert commit_ready(t) == [(20, "state_dict")]
        for step in (15, 20):
            (note,) = t.register(step, state_dict_count=1)
            assert f"step {step} (state_dict) ignored" in note and "latest committed is 20" in note
        assert t.pending() == [] and t.latest["state_dict"] == 20

    def test_open_step_below_a_committed_one_is_closed_not_left_pending(self):
        t = CommitTracker()
        t.start(1, "checkpoint")  # a rank died mid-save: never finishes
        t.register(1, checkpoint_count=1)
        t.submit(1, "checkpoint")
        t.register(2, checkpoint_count=1)
        t.start(2, "checkpoint")
        t.finish(2, "checkpoint")
        t.submit(2, "checkpoint")
        assert commit_ready(t) == [(2, "checkpoint")]
        assert t.pending() == []
        assert t.progress(1, "checkpoint").state == ABANDONED
        assert "step 2 was committed first" in t.abandoned[1]
        t.finish(1, "checkpoint")  # the late finish is accepted and changes nothing
        assert commit_ready(t) == [] and t.latest["checkpoint"] == 2

    def test_submit_older_than_committed_is_a_no_op(self):
        t = CommitTracker(latest={"checkpoint": 9, "state_dict": 9})
        assert t.submit(7, "checkpoint") == []
        assert commit_ready(t) == [] and t.latest["checkpoint"] == 9 and t.pending() == []

    def test_resubmitting_the_committed_step_is_a_no_op(self):
        t = CommitTracker(latest={"checkpoint": 9, "state_dict": 9})
        t.submit(9, "state_dict")
        assert commit_ready(t) == []

    def test_save_into_committed_step_is_not_counted(self):
        t = CommitTracker(latest={"checkpoint": 4, "state_dict": 4})
        assert t.start(4, "state_dict") is False
        assert t.finish(4, "state_dict") == []
        assert t.pending() == [] and t.latest == {"checkpoint": 4, "state_dict": 4}
        assert t.resaves == 2

    def test_checkpoint_waits_for_a_state_dict_resave_of_its_step(self):
        """Checkpoint-sync commits step 5, then a full save of step 5 rewrites its model."""
        t = CommitTracker()
        t.register(5, state_dict_count=1)
        assert t.start(5, "state_dict")
        t.finish(5, "state_dict")
        t.submit(5, "state_dict")
        assert commit_ready(t) == [(5, "state_dict")]
        assert t.start(5, "state_dict") is False  # the full save's model, reported as a state dict
        t.register(5, checkpoint_count=1)
        assert t.start(5, "checkpoint")
        t.finish(5, "checkpoint")
        assert t.register(5, state_dict_count=1)  # ignored, with a note
        t.submit(5, "checkpoint")
        assert commit_ready(t) == []  # the model re-save is still writing
        assert t.finish(5, "state_dict", resave=True) == []
        assert commit_ready(t) == [(5, "checkpoint")]
        assert t.latest == {"checkpoint": 5, "state_dict": 5}

    def test_full_save_reported_as_a_state_dict_before_its_registration(self):
        """Trinity's order: checkpoint sync of step 3 is still writing when the full save
        of step 3 runs (reported as a state-dict save) and is registered afterwards."""
        t = CommitTracker()
        t.register(3, state_dict_count=1)
        t.submit(3, "state_dict")
        assert t.start(3, "state_dict")  # checkpoint sync, in the background
        assert t.start(3, "state_dict")  # the full save, synchronous
        assert t.finish(3, "state_dict") == []
        assert t.finish(3, "state_dict") == []  # 2 finished, 1 registered: waits
        assert commit_ready(t) == [] and t.failed() == []
        assert t.register(3, state_dict_count=1) == []
        assert commit_ready(t) == [(3, "state_dict")]
        t.submit(3, "checkpoint")
        assert commit_ready(t) == [(3, "checkpoint")]
        assert t.latest == {"checkpoint": 3, "state_dict": 3}

    def test_failed_state_dict_resave_fails_the_open_checkpoint(self):
        t = CommitTracker(latest={"state_dict": 5})
        t.register(5, checkpoint_count=1)
        assert t.start(5, "state_dict") is False
        failed = t.finish(5, "state_dict", ok=False, error="disk full", resave=True)
        assert failed == [(5, "checkpoint")]
        assert "disk full" in t.progress(5, "checkpoint").error
        t.submit(5, "checkpoint")
        assert commit_ready(t) == []

    @pytest.mark.parametrize("bad", [-1, 1.5, "3", True, None])
    def test_bad_steps_are_named(self, bad):
        t = CommitTracker()
        with pytest.raises(ValueError, match=repr(bad) if not isinstance(bad, int) else str(bad)):
            t.submit(bad, "checkpoint")

    def test_bad_counts_are_named(self):
        t = CommitTracker()
        with pytest.raises(ValueError, match="checkpoint_thread_count .* got -2"):
            t.register(1, checkpoint_count=-2)


class TestViews:
    """Pending steps and their start times are what the gauges and status() show."""

    def test_pending_and_oldest_start(self):
        clock = iter(range(100, 200)).__next__
        t = CommitTracker(clock=lambda: float(clock()))
        t.start(1, "checkpoint")
        t.start(2, "checkpoint")
        assert [s for s, _, _ in t.pending("checkpoint")] == [1, 2]
        assert t.oldest_pending_start("checkpoint") == t.progress(1, "checkpoint").first_start
        t.register(1, checkpoint_count=1)
        t.finish(1, "checkpoint")
        t.submit(1, "checkpoint")
        commit_ready(t)
        assert [s for s, _, _ in t.pending("checkpoint")] == [2]
        assert t.oldest_pending_start("state_dict") is None


# ---------------------------------------------------------------------------
# Randomised interleavings
# ---------------------------------------------------------------------------

STEPS = st.integers(min_value=0, max_value=6)
KIND = st.sampled_from(["checkpoint", "state_dict"])


class CommitMachine(RuleBasedStateMachine):
    """Whatever the interleaving, only whole steps commit and nothing goes backwards.

    The model keeps, per (step, kind), the saves that were registered,
    started, finished and failed, independently of the tracker. After every
    commit the invariant checks that the committed step was whole in the
    model at that moment.
    """

    def __init__(self):
        super().__init__()
        self.t = CommitTracker()
        self.registered: dict[tuple[int, str], int] = {}
        self.started: dict[tuple[int, str], int] = {}
        self.finished: dict[tuple[int, str], int] = {}
        self.failed: set[tuple[int, str]] = set()
        self.submitted: set[tuple[int, str]] = set()
        # Re-saves into closed steps: started and finished, not counted by the tracker.
        self.resaving: dict[tuple[int, str], int] = {}
        self.history: dict[str, list[int]] = {"checkpoint": [], "state_dict": []}

    def _whole(self, step: int, kind: str) -> bool:
        key = (step, kind)
        ok = (
            key in self.submitted
            and key not in self.failed
            and self.finished.get(key, 0) == self.registered.get(key, 0)
            and self.started.get(key, 0) <= self.finished.get(key, 0)
        )
        if kind == "checkpoint":
            sd = (step, "state_dict")
            ok = ok and sd not in self.failed
            ok = ok and self.finished.get(sd, 0) == self.registered.get(sd, 0)
            ok = ok and self.started.get(sd, 0) <= self.finished.get(sd, 0)
            # A state-dict re-save still writing into the step's directory.
            ok = ok and self.resaving.get(sd, 0) == 0
        return ok

    def _commit(self):
        while ready := self.t.ready():
            for step, kind in ready:
                assert self._whole(step, kind), f"step {step} ({kind}) committed while not whole"
                self.t.begin_commit(step, kind)
                self.t.end_commit(step, kind, ok=True)
                self.history[kind].append(step)
                if kind == "checkpoint" and (
                    not self.history["state_dict"] or self.history["state_dict"][-1] < step
                ):
                    self.history["state_dict"].append(step)

    @rule(step=STEPS, kind=KIND, n=st.integers(1, 3))
    def register(self, step, kind, n):
        closed = self.t.closed(step, kind)
        try:
            notes = self.t.register(
                step,
                state_dict_count=n if kind == "state_dict" else 0,
                checkpoint_count=n if kind == "checkpoint" else 0,
            )
        except NotificationError:
            return
        # A closed step (committed, or below the committed one) ignores registrations.
        assert len(notes) == int(closed), (step, kind, notes)
        if closed:
            latest = self.t.latest[kind]
            assert (latest is not None and step <= latest) or self.t.progress(step, kind).state in (
                COMMITTED,
                COMMITTING,
                SUPERSEDED,
            )
            return
        self.registered[(step, kind)] = self.registered.get((step, kind), 0) + n
        self._commit()

    @rule(step=STEPS, kind=KIND)
    def start(self, step, kind):
        if self.t.start(step, kind):
            self.started[(step, kind)] = self.started.get((step, kind), 0) + 1
        else:
            self.resaving[(step, kind)] = self.resaving.get((step, kind), 0) + 1

    @precondition(
        lambda self: any(self.started.get(k, 0) > self.finished.get(k, 0) for k in self.started)
    )
    @rule(data=st.data(), ok=st.booleans())
    def finish(self, data, ok):
        open_keys = sorted(k for k in self.started if self.started[k] > self.finished.get(k, 0))
        step, kind = data.draw(st.sampled_from(open_keys))
        self.finished[(step, kind)] = self.finished.get((step, kind), 0) + 1
        try:
            self.t.finish(step, kind, ok=ok, error=None if ok else "injected")
        except NotificationError:
            raise AssertionError("finish never raises") from None
        if not ok:
            self.failed.add((step, kind))
            if kind == "state_dict":
                self.failed.add((step, "checkpoint"))
        self._commit()

    @precondition(lambda self: any(self.resaving.values()))
    @rule(data=st.data(), ok=st.booleans())
    def finish_resave(self, data, ok):
        step, kind = data.draw(st.sampled_from(sorted(k for k, n in self.resaving.items() if n)))
        self.resaving[(step, kind)] -= 1
        failed = self.t.finish(step, kind, ok=ok, error=None if ok else "injected", resave=True)
        self.failed.update(failed)
        self._commit()

    @rule(step=STEPS, kind=KIND)
    def submit(self, step, kind):
        latest = self.t.latest[kind]
        try:
            self.t.submit(step, kind)
        except NotificationError:
            self.failed.add((step, kind))
            return
        if latest is not None and step < latest:
            assert self.t.latest[kind] == latest  # ignored: nothing moves
            return
        self.submitted.add((step, kind))
        self._commit()

    @invariant()
    def never_backwards(self):
        for kind, steps in self.history.items():
            assert steps == sorted(steps) and len(set(steps)) == len(steps), (kind, steps)
            assert self.t.latest[kind] == (steps[-1] if steps else None)

    @invariant()
    def failed_steps_never_committed(self):
        for step, kind in self.failed:
            assert step not in self.history[kind], (step, kind, self.history)


CommitMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)
TestCommitMachine = CommitMachine.TestCase
