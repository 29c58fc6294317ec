"""Proving a resume bit-exact: ``--kill-at`` kills the job, ``--check-resume`` compares.

``--kill-at K`` sends SIGKILL to the job's trainer ranks and rollout (those on
this node) and then to the driver itself, at the end of step K; ``K:save``
does it while step K's checkpoint is being written (every rank's snapshot
taken, the writes in flight, the step not yet submitted), so step K never
commits. No handler runs: what is on disk is what a crash leaves.

``--check-resume REF`` compares a (resumed) run with REF, the ``--result-json``
of an uninterrupted run with the same seed: the data order and weight version
of every step both trained, and at the last step the CRC32s of the weights,
the optimizer and LR scheduler state, the RNGs, the data position and the
user state of every rank.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

from obsckpt.demo.config import DemoResult
from obsckpt.errors import DemoError


def kill_targets(trainers: list[Any], rollout: Any) -> list[tuple[str, int]]:
    """(node, pid) of every trainer rank and the rollout, asked at the start."""
    import ray

    return ray.get([t.pid.remote() for t in trainers] + [rollout.pid.remote()])


def kill_job(targets: list[tuple[str, int]], say) -> None:
    """SIGKILL the job's processes on this node, then this process. Does not return."""
    import ray.util

    here = ray.util.get_node_ip_address()
    local = [pid for node, pid in targets if node == here]
    say(f"--kill-at: SIGKILL to {len(local)} of the job's processes on this node and to the driver")
    for pid in local:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    os.kill(os.getpid(), signal.SIGKILL)


def final_digest(trainers: list[Any]) -> dict[str, str]:
    """The whole training state's CRC32s, each part joined over ranks (``r0,r1``)."""
    import ray

    per_rank = ray.get([t.state_digest.remote() for t in trainers])
    out = {"weights": per_rank[0]["weights"]}  # gathered: rank 0 has the full weights'
    for key in per_rank[0]:
        if key != "weights":
            out[key] = ",".join(str(d[key]) for d in per_rank)
    return out


def load_reference(path: str) -> dict[str, Any]:
    """The reference run's result JSON, checked to hold what the comparison needs.

    Raises:
        DemoError: unreadable, not JSON, or not a result of this demo's version.
    """
    try:
        data = json.loads(Path(path).expanduser().read_text())
    except (OSError, ValueError) as exc:
        raise DemoError(
            f"--check-resume {path} cannot be read ({exc}); pass the --result-json file of an "
            "uninterrupted run with the same seed"
        ) from None
    needed = ("first_step", "last_step", "data_digests", "final_digest", "rollout_versions")
    missing = [k for k in needed if not isinstance(data, dict) or k not in data]
    if missing or not data.get("final_digest"):
        raise DemoError(
            f"--check-resume {path} is not the result of a completed demo run (no "
            f"{', '.join(missing) or 'final_digest'}); write one with --result-json"
        )
    return data


def check_resume(reference: dict[str, Any], result: DemoResult) -> tuple[bool, str]:
    """Compare ``result`` with the reference run; (matched, the line that says so)."""
    last = result.last_step
    if reference["last_step"] != last:
        return False, (
            f"resume check: MISMATCH: the reference run ended at step {reference['last_step']}, "
            f"this one at step {last}; pass --steps so that both end at the same step"
        )
    ref_first = reference["first_step"]
    for offset, got in enumerate(result.data_digests):
        step = result.first_step + offset
        want = reference["data_digests"][step - ref_first] if step >= ref_first else None
        if got != want:
            return False, (
                f"resume check: MISMATCH at step {step}: the ranks trained on other data "
                f"(batch crc32 {got} vs {want}): the data position or RNGs were not restored"
            )
    resumed = result.resumed_from or 0
    want_versions = [v for v in reference["rollout_versions"] if v > resumed]
    if result.rollout_versions != want_versions:
        return False, (
            f"resume check: MISMATCH: the rollout got versions {result.rollout_versions}, the "
            f"reference run {want_versions} after step {resumed}"
        )
    for key, ref_crc in reference["final_digest"].items():
        crc = result.final_digest.get(key)
        if crc != ref_crc:
            return False, (
                f"resume check: MISMATCH at step {last}: {key} crc32 {crc} vs the reference "
                f"run's {ref_crc}"
            )
    return True, (
        f"resume check: matched the uninterrupted run bit for bit at step {last} (weights "
        f"{result.final_digest['weights']}, optimizer, LR scheduler, RNGs, data position, "
        f"user state), data order of steps {result.first_step}-{last}, weight versions "
        f"{result.rollout_versions[0] if result.rollout_versions else '-'}-"
        f"{result.rollout_versions[-1] if result.rollout_versions else '-'}"
    )
