"""The commit state machine, without Ray: examples for each rule and a randomised search."""

from __future__ import annotations

import time

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from obsckpt.errors import NotificationError, PartsMismatchError
from obsckpt.store.layout import FileRecord
from obsckpt.tracker import (
    ABANDONED,
    COMMITTED,
    COMMITTING,
    FAILED,
    SUPERSEDED,
    CommitTracker,
)

SLOT = "model_state_dict"


def part(rank: int, world: int = 2) -> dict:
    return {"slot": SLOT, "part": rank, "parts": world}


def commit_ready(t: CommitTracker) -> list[tuple[int, str]]:
    """What the monitor does: commit everything ready, in order, until nothing is."""
    done = []
    while (nxt := t.begin_next_commit()) is not None:
        step, kind, _ = nxt
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


class TestFiles:
    """Files the saves reported go into the manifest unread, unless two saves disagree."""

    def test_a_file_two_saves_reported_differently_is_left_to_the_commit(self):
        t = CommitTracker()
        t.register(2, state_dict_count=1, checkpoint_count=2)
        for kind in ("state_dict", "checkpoint", "checkpoint"):
            t.start(2, kind)
        model = "actor/model_world_size_1_rank_0.pt"
        # Two saves of one step wrote the same file; which write is on disk only the disk knows.
        t.finish(2, "checkpoint", files=[FileRecord(model, 10, 1), FileRecord("a.pt", 5, 7)])
        t.finish(2, "checkpoint", files=[FileRecord(model, 10, 2), FileRecord("a.pt", 5, 7)])
        t.finish(2, "state_dict", files=[FileRecord(model, 10, 1)])
        p = t.progress(2, "checkpoint")
        assert p.files == {"a.pt": FileRecord("a.pt", 5, 7)}
        # A third report agreeing with one of them does not settle it.
        t.finish(2, "checkpoint", started=False, files=[FileRecord(model, 10, 2)])
        assert model not in p.files
        assert t.progress(2, "state_dict").files == {model: FileRecord(model, 10, 1)}
        # The checkpoint's commit trusts neither; the state dict's own commit has one report.
        assert t.reported_files(2, "checkpoint") == {"a.pt": FileRecord("a.pt", 5, 7)}
        assert t.reported_files(2, "state_dict") == {model: FileRecord(model, 10, 1)}

    def test_a_checkpoint_commit_checks_state_dict_reports_against_its_own(self):
        t = CommitTracker()
        model, extra = "actor/model.pt", "actor/extra.pt"
        t.finish(3, "state_dict", started=False, files=[FileRecord(model, 10, 1)])
        t.finish(3, "checkpoint", started=False, files=[FileRecord(extra, 4, 9)])
        # Reported by the state-dict save only: trusted by the full checkpoint's commit too.
        assert t.reported_files(3, "checkpoint") == {
            model: FileRecord(model, 10, 1),
            extra: FileRecord(extra, 4, 9),
        }
        t.finish(3, "checkpoint", started=False, files=[FileRecord(model, 10, 3)])
        assert t.reported_files(3, "checkpoint") == {extra: FileRecord(extra, 4, 9)}


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

    def test_failed_save_into_an_abandoned_state_dict_fails_its_checkpoint(self):
        t = CommitTracker()
        t.start(1, "state_dict")
        t.submit(2, "state_dict")
        assert commit_ready(t) == [(2, "state_dict")]  # step 1's state dict is abandoned
        t.finish(1, "state_dict", ok=False, error="disk full")
        t.submit(1, "checkpoint")
        assert commit_ready(t) == []
        assert t.progress(1, "checkpoint").state == FAILED
        assert "disk full" in t.progress(1, "checkpoint").error

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
        step, kind, _ = t.begin_next_commit()
        assert (step, kind) == (7, "state_dict")
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

    def test_a_long_job_keeps_only_its_newest_abandoned_steps(self):
        t = CommitTracker(latest={"checkpoint": None, "state_dict": None})
        t.mark_abandoned(1000, "found on disk uncommitted")  # above every commit: kept
        for step in range(0, 400, 2):  # each even step left open, the next one committed
            t.start(step, "checkpoint")
            t.register(step + 1, checkpoint_count=1, state_dict_count=0)
            t.start(step + 1, "checkpoint")
            t.finish(step + 1, "checkpoint")
            t.submit(step + 1, "checkpoint")
            assert commit_ready(t) == [(step + 1, "checkpoint")]
        assert t.latest["checkpoint"] == 399
        kept = sorted(t.abandoned)
        assert kept[-1] == 1000 and kept[:-1] == list(range(400 - 2 * 64, 400, 2))
        assert len(t.steps) <= 2 * 64

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


class TestParts:
    """A save made of parts (one per rank) counts once, when every part finished ok."""

    def test_every_part_is_one_save_with_every_file(self):
        t = CommitTracker()
        t.register(1, state_dict_count=1)  # one save per step, as Trinity registers it
        t.submit(1, "state_dict")
        for rank in (0, 1):
            t.start(1, "state_dict", **part(rank))
        t.finish(1, "state_dict", files=[FileRecord("rank_0.pt", 1, 1)], **part(0))
        assert commit_ready(t) == []
        t.finish(1, "state_dict", files=[FileRecord("rank_1.pt", 1, 2)], **part(1))
        assert t.progress(1, "state_dict").finished == 1
        assert sorted(t.progress(1, "state_dict").files) == ["rank_0.pt", "rank_1.pt"]
        assert commit_ready(t) == [(1, "state_dict")]

    def test_a_part_that_starts_late_holds_the_commit_back(self):
        t = CommitTracker()
        t.register(2, state_dict_count=1)
        t.submit(2, "state_dict")
        # Rank 0 starts and finishes before rank 1 has started: counts balance
        # by number (one finish, one registration), but the save is not whole.
        t.start(2, "state_dict", **part(0))
        t.finish(2, "state_dict", **part(0))
        assert commit_ready(t) == []
        assert [s for s, _, _ in t.pending("state_dict")] == [2]
        t.start(2, "state_dict", **part(1))
        assert commit_ready(t) == []
        t.finish(2, "state_dict", **part(1))
        assert commit_ready(t) == [(2, "state_dict")]

    def test_an_unfinished_split_save_holds_the_step_even_when_other_saves_meet_the_count(self):
        t = CommitTracker()
        t.register(3, state_dict_count=1)
        t.submit(3, "state_dict")
        t.start(3, "state_dict", **part(0))
        t.finish(3, "state_dict", **part(0))
        t.start(3, "state_dict")  # an unsplit save meets the registered count
        t.finish(3, "state_dict")
        assert t.progress(3, "state_dict").finished == 1
        assert commit_ready(t) == []  # the split save is still missing part 1
        t.start(3, "state_dict", **part(1))
        t.finish(3, "state_dict", **part(1))
        # Now two saves finished against one registration: the step waits, as for
        # any unbalanced count, until the trainer registers the other save.
        assert commit_ready(t) == []
        t.register(3, state_dict_count=1)
        assert commit_ready(t) == [(3, "state_dict")]

    def test_a_failed_part_fails_the_step_and_its_checkpoint(self):
        t = CommitTracker()
        t.register(4, state_dict_count=1, checkpoint_count=1)
        t.start(4, "checkpoint")
        for rank in (0, 1):
            t.start(4, "state_dict", **part(rank))
        t.finish(4, "state_dict", **part(0))
        failed = t.finish(4, "state_dict", ok=False, error="disk full", **part(1))
        assert failed == [(4, "state_dict"), (4, "checkpoint")]
        t.finish(4, "checkpoint")
        t.submit(4, "state_dict")
        t.submit(4, "checkpoint")
        assert commit_ready(t) == []
        assert t.progress(4, "state_dict").state == FAILED
        assert "disk full" in t.progress(4, "state_dict").error

    def test_conflicting_parts_fail_the_step_with_a_clear_error(self):
        t = CommitTracker()
        t.register(5, state_dict_count=1)
        t.start(5, "state_dict", **part(0, world=2))
        with pytest.raises(
            PartsMismatchError, match=r"part 1 says the save has 3 parts but an earlier part said 2"
        ) as info:
            t.start(5, "state_dict", **part(1, world=3))
        assert info.value.failed == [(5, "state_dict")]
        t.finish(5, "state_dict", **part(0))
        t.submit(5, "state_dict")
        assert commit_ready(t) == []
        assert t.progress(5, "state_dict").state == FAILED
        # A finish that contradicts the known count fails the step too (no raise).
        t.register(6, state_dict_count=1)
        t.start(6, "state_dict", **part(0, world=2))
        assert t.finish(6, "state_dict", started=False, **part(1, world=4)) == [(6, "state_dict")]
        assert "earlier part said 2" in t.progress(6, "state_dict").error

    def test_other_slots_and_steps_are_separate_saves(self):
        t = CommitTracker()
        t.register(7, state_dict_count=2)
        t.submit(7, "state_dict")
        for slot in ("a", "b"):
            t.start(7, "state_dict", slot=slot, part=0, parts=1)
            t.finish(7, "state_dict", slot=slot, part=0, parts=1)
        t.start(7, "state_dict", slot="c", part=0, parts=3)  # a different parts is no conflict
        assert t.finish(7, "state_dict", slot="c", part=0, parts=3) == []
        assert commit_ready(t) == []  # slot c is open
        for rank in (1, 2):
            t.start(7, "state_dict", slot="c", part=rank, parts=3)
            t.finish(7, "state_dict", slot="c", part=rank, parts=3)
        t.register(7, state_dict_count=1)
        assert commit_ready(t) == [(7, "state_dict")]

    def test_parts_into_a_committed_step_are_resaves(self):
        t = CommitTracker()
        t.register(8, state_dict_count=1)
        t.submit(8, "state_dict")
        for rank in (0, 1):
            t.start(8, "state_dict", **part(rank))
            t.finish(8, "state_dict", **part(rank))
        assert commit_ready(t) == [(8, "state_dict")]
        before = t.resaves
        # Even a part with another count: the step is closed, nothing is checked or counted.
        assert t.start(8, "state_dict", **part(0, world=5)) is False
        assert t.finish(8, "state_dict", resave=True, **part(0, world=5)) == []
        assert t.resaves == before + 2 and t.latest["state_dict"] == 8

    @pytest.mark.parametrize(
        "kwargs,message",
        [
            ({"part": 0}, r"parts must be a positive integer .* got None"),
            ({"part": 0, "parts": 0}, r"parts must be a positive integer .* got 0"),
            ({"part": 2, "parts": 2}, r"part must be an integer in \[0, parts=2\) .* got 2"),
            ({"part": None, "parts": 2}, r"part must be .* got None"),
            ({"part": True, "parts": 2}, r"part must be .* got True"),
            ({"part": 0, "parts": 1.0}, r"parts must be .* got 1.0"),
        ],
    )
    def test_bad_parts_are_named(self, kwargs, message):
        t = CommitTracker()
        with pytest.raises(ValueError, match=message):
            t.start(1, "state_dict", slot=SLOT, **kwargs)
        with pytest.raises(ValueError, match=message):
            t.finish(1, "state_dict", slot=SLOT, **kwargs)
        assert t.steps == {}


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

    def test_times_are_read_on_the_monotonic_clock(self):
        """Ages and the commit lag are differences of these times: a step of the wall
        clock (NTP, a resumed VM) must not reach them."""
        before = time.monotonic()
        t = CommitTracker()
        t.start(1, "checkpoint")
        t.lose(1, "the monitor restarted")
        p = t.progress(1, "checkpoint")
        assert before <= p.started_at <= p.resolved_at <= time.monotonic()


# ---------------------------------------------------------------------------
# Randomised interleavings
# ---------------------------------------------------------------------------

STEPS = st.integers(min_value=0, max_value=6)
KIND = st.sampled_from(["checkpoint", "state_dict"])
PARTS = 2


class CommitMachine(RuleBasedStateMachine):
    """Whatever the interleaving, only whole steps commit and nothing goes backwards.

    The model keeps, per (step, kind), the saves that were registered,
    started, finished and failed, independently of the tracker. After every
    commit the invariant checks that the committed step was whole in the
    model at that moment. Saves also come as parts of one save made of
    ``PARTS`` parts (one slot per step and kind): such a save counts once
    when every part has finished, and holds its step while it is partial.
    """

    def __init__(self):
        super().__init__()
        self.t = CommitTracker()
        self.registered: dict[tuple[int, str], int] = {}
        self.started: dict[tuple[int, str], int] = {}
        self.finished: dict[tuple[int, str], int] = {}
        # Finishes of counted saves whose step had closed meanwhile (not counted).
        self.late: dict[tuple[int, str], int] = {}
        self.failed: set[tuple[int, str]] = set()
        self.submitted: set[tuple[int, str]] = set()
        # Re-saves into closed steps: started and finished, not counted by the tracker.
        self.resaving: dict[tuple[int, str], int] = {}
        # Parts of the split save, by (step, kind, part): started, ended, and
        # finished ok while their step was open (the ones that count).
        self.pstarted: dict[tuple[int, str, int], int] = {}
        self.pended: dict[tuple[int, str, int], int] = {}
        self.pdone: dict[tuple[int, str, int], int] = {}
        self.history: dict[str, list[int]] = {"checkpoint": [], "state_dict": []}

    def _ended(self, key: tuple[int, str]) -> int:
        return self.finished.get(key, 0) + self.late.get(key, 0)

    def _balanced(self, key: tuple[int, str]) -> bool:
        """Every registered save finished, none runs, no split save is partial."""
        started = [self.pstarted.get((*key, i), 0) for i in range(PARTS)]
        ended = [self.pended.get((*key, i), 0) for i in range(PARTS)]
        done = [self.pdone.get((*key, i), 0) for i in range(PARTS)]
        split_saves = min(done)
        return (
            self.finished.get(key, 0) + split_saves == self.registered.get(key, 0)
            and self.started.get(key, 0) <= self.finished.get(key, 0) + self.late.get(key, 0)
            and started == ended
            and all(n == split_saves for n in done)
        )

    def _whole(self, step: int, kind: str) -> bool:
        key = (step, kind)
        ok = key in self.submitted and key not in self.failed and self._balanced(key)
        if kind == "checkpoint":
            sd = (step, "state_dict")
            ok = ok and sd not in self.failed and self._balanced(sd)
            # A state-dict re-save still writing into the step's directory.
            ok = ok and self.resaving.get(sd, 0) == 0
        return ok

    def _commit(self):
        while (nxt := self.t.begin_next_commit()) is not None:
            step, kind, _ = nxt
            assert self._whole(step, kind), f"step {step} ({kind}) committed while not whole"
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

    @precondition(lambda self: any(self.started.get(k, 0) > self._ended(k) for k in self.started))
    @rule(data=st.data(), ok=st.booleans())
    def finish(self, data, ok):
        open_keys = sorted(k for k in self.started if self.started[k] > self._ended(k))
        step, kind = data.draw(st.sampled_from(open_keys))
        into = self.late if self.t.closed(step, kind) else self.finished
        into[(step, kind)] = into.get((step, kind), 0) + 1
        try:
            self.t.finish(step, kind, ok=ok, error=None if ok else "injected")
        except NotificationError:
            raise AssertionError("finish never raises") from None
        if not ok:
            self.failed.add((step, kind))
            if kind == "state_dict":
                self.failed.add((step, "checkpoint"))
        self._commit()

    @rule(step=STEPS, kind=KIND, index=st.integers(0, PARTS - 1))
    def start_part(self, step, kind, index):
        if self.t.start(step, kind, slot="split", part=index, parts=PARTS):
            key = (step, kind, index)
            self.pstarted[key] = self.pstarted.get(key, 0) + 1
        else:
            self.resaving[(step, kind)] = self.resaving.get((step, kind), 0) + 1

    @precondition(lambda self: any(n > self.pended.get(k, 0) for k, n in self.pstarted.items()))
    @rule(data=st.data(), ok=st.booleans())
    def finish_part(self, data, ok):
        running = sorted(k for k, n in self.pstarted.items() if n > self.pended.get(k, 0))
        step, kind, index = data.draw(st.sampled_from(running))
        key = (step, kind, index)
        self.pended[key] = self.pended.get(key, 0) + 1
        if ok and not self.t.closed(step, kind):
            self.pdone[key] = self.pdone.get(key, 0) + 1
        self.t.finish(
            step,
            kind,
            ok=ok,
            error=None if ok else "injected",
            slot="split",
            part=index,
            parts=PARTS,
        )
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
