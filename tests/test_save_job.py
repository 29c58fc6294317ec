"""A save's outcome is one Future, settled once, and the monitor hears of it once.

These run a :class:`SaveJob` against a hand-written link (no Ray): the save
and the ``save_timeout`` watchdog race to settle the outcome, and whichever
wins is the one report the monitor gets.
"""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch

from obsckpt import CheckpointCoordinator
from obsckpt.errors import SaveError, SaveTimeoutError
from obsckpt.save_job import SaveErrors, SaveJob

QUIET = logging.getLogger("obsckpt.test_save_job.quiet")
QUIET.propagate = False


class FakeLink:
    """Admits every save at once and records each report."""

    rank = 0

    def __init__(self, *, skip: bool = False, finish_error: BaseException | None = None):
        self.skip = skip
        self.finish_error = finish_error
        self.reports: list[dict] = []
        self.lock = threading.Lock()

    def admit(self, slot, step, kind, **_kwargs) -> dict:
        return {"ticket": 7, "skipped": self.skip, "latest": step}

    def drop_lease(self, ticket) -> None:
        pass

    def finished(self, slot, step, kind, ticket, **report) -> None:
        if self.finish_error is not None:
            raise self.finish_error
        with self.lock:
            self.reports.append({"slot": slot, "step": step, **report})

    def failed(self, slot, step, kind, ticket, exc, **kwargs) -> None:
        with self.lock:
            self.reports.append({"slot": slot, "step": step, "ok": False, "exc": exc})


def _job(link, **kwargs) -> SaveJob:
    return SaveJob("model", 3, "checkpoint", link=link, logger=QUIET, **kwargs)


class TestOneOutcome:
    """Every save settles its outcome once and reports once, whatever ends it."""

    def test_a_save_that_runs_ok_is_written_and_reported_once(self):
        link = FakeLink()
        job = _job(link)
        job.run(lambda: [], None, 0.0)
        assert job.outcome.result(timeout=5) is True and job.ended()
        assert [r["ok"] for r in link.reports] == [True]

    def test_a_save_the_monitor_skips_is_not_written_nor_reported(self):
        link, skipped = FakeLink(skip=True), []
        job = _job(link, unless_committed=True, on_skip=lambda: skipped.append(1))
        job.run(lambda: pytest.fail("a skipped save must not write"), None, 0.0)
        assert job.outcome.result(timeout=5) is False
        assert skipped == [1] and link.reports == []

    def test_a_failure_is_stored_before_the_outcome_wakes_a_waiter(self):
        link, seen = FakeLink(), []
        job = _job(link, on_error=lambda e: seen.append((e, job.outcome.done())))

        def fail():
            raise OSError(28, "No space left on device")

        job.run(fail, None, 0.0)
        error = job.outcome.exception(timeout=5)
        assert isinstance(error, SaveError) and isinstance(error.__cause__, OSError)
        assert (error.slot, error.step) == ("model", 3)
        assert seen == [(error, False)]
        assert [r["ok"] for r in link.reports] == [False]

    def test_a_report_that_fails_fails_the_save(self):
        job = _job(FakeLink(finish_error=TimeoutError("monitor unreachable")))
        job.run(lambda: [], None, 0.0)
        with pytest.raises(SaveError, match="finished, but reporting it to the monitor failed"):
            job.outcome.result(timeout=5)

    def test_a_failure_is_one_line_without_colour_and_keeps_its_cause(self):
        """A Ray error's text is its remote traceback, in colour: the SaveError is one line."""
        remote = RuntimeError("ray::CheckpointMonitor.notify_finished()\n  \x1b[36mFile x\x1b[0m")
        job = _job(FakeLink(finish_error=remote))
        job.run(lambda: [], None, 0.0)
        error = job.outcome.exception(timeout=5)
        assert str(error) == (
            "background save 'model' of step 3 (checkpoint) finished, but reporting it to "
            "the monitor failed: RuntimeError: ray::CheckpointMonitor.notify_finished() File x"
        )
        assert error.__cause__ is remote


class TestWatchdog:
    """A save past ``save_timeout`` fails once, by the watchdog; its late end reports nothing."""

    def test_the_watchdog_settles_and_the_late_save_stays_silent(self):
        link, stored, release = FakeLink(), [], threading.Event()
        job = _job(link, save_timeout=0.1, on_error=stored.append)
        runner = threading.Thread(target=job.run, args=(lambda: release.wait(10) and [], None, 0))
        runner.start()
        with pytest.raises(SaveTimeoutError, match="did not finish within save_timeout=0.1 s"):
            job.outcome.result(timeout=5)
        assert not job.ended()  # still writing: its slot stays busy
        release.set()
        runner.join(5)
        assert job.ended()
        assert len(link.reports) == 1 and isinstance(link.reports[0]["exc"], SaveTimeoutError)
        assert len(stored) == 1

    def test_a_save_ending_as_the_watchdog_fires_is_reported_once(self):
        """The save and the watchdog race to claim the outcome; exactly one wins."""
        for i in range(200):
            link, stored = FakeLink(), []
            job = _job(link, save_timeout=0.002, on_error=stored.append)
            job.run(lambda i=i: time.sleep(0.002 + (i % 5) * 0.0005) or [], None, 0.0)
            job.outcome.exception(timeout=5)  # settled, by one of them
            assert len(link.reports) == 1, link.reports
            assert len(stored) == (0 if job.outcome.exception() is None else 1)


class TestSaveErrors:
    """Failures are handed over once, the first with its traceback."""

    def test_take_hands_over_once_and_only_the_first_keeps_its_frames(self):
        errors = SaveErrors()
        for step in (1, 2):
            try:
                raise OSError("disk")
            except OSError as exc:
                error = SaveError(f"step {step} failed", slot="m", step=step)
                error.__cause__ = exc
                errors.add(error)
        first, second = errors.pending()
        assert first.__cause__.__traceback__ is not None
        assert second.__cause__.__traceback__ is None
        assert errors.take() == [first, second]
        assert errors.take() == [] and errors.pending() == []


def test_the_coordinator_is_a_context_manager_that_closes(caplog):
    """Leaving the ``with`` block releases every slot's staging, as close() does."""
    with CheckpointCoordinator(None, rank=0) as coord:
        coord.prepare("model", {"w": torch.zeros(1024)})
        assert coord.staging_bytes("model")[0] > 0
    assert coord.staging_bytes() == (0, 0)
