"""The names, types, labels and meanings of obsckpt's metrics and spans: the contract.

Dashboards, alert rules and users' own queries depend on these names; they
change only deliberately. :mod:`obsckpt.telemetry.metrics` makes the metric
objects from them and re-exports every name here.
"""

from __future__ import annotations

from dataclasses import dataclass

from obsckpt.telemetry.vocabulary import OVERFLOW_SLOT

__all__ = ["DURATION_BUCKETS", "METRICS", "SPANS", "MetricSpec", "SpanSpec"]

# Milliseconds to two hours: snapshot copies take ms; a shard of a 70B model's
# checkpoint on network storage takes minutes, and a save admitted one node at a
# time, or the commit lag of a whole step, waits for many of those.
DURATION_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
    600.0,
    1200.0,
    1800.0,
    3600.0,
    7200.0,
)


@dataclass(frozen=True, slots=True)
class MetricSpec:
    name: str
    type: str
    labels: tuple[str, ...]
    help: str
    attr: str
    # A last-value gauge: the attr of the histogram whose last observation it holds
    # (Metrics.observe sets both), or of the counter whose last increment it holds
    # (Metrics.add sets both). Its series appear with that first observation:
    # a 0 before it would read as a measurement.
    last_of: str | None = None


@dataclass(frozen=True, slots=True)
class SpanSpec:
    name: str
    where: str
    help: str


METRICS: tuple[MetricSpec, ...] = (
    MetricSpec(
        "obsckpt_save_duration_seconds",
        "histogram",
        ("slot", "kind"),
        "Time one background save took, from admission to its files being fsynced.",
        "save_duration",
    ),
    MetricSpec(
        "obsckpt_saves_total",
        "counter",
        ("slot", "kind", "result"),
        "Saves finished, by result (ok or error); both series of a slot exist from its first "
        "admitted save.",
        "saves",
    ),
    MetricSpec(
        "obsckpt_save_bytes_total",
        "counter",
        ("slot", "kind"),
        "Bytes written by successful saves.",
        "save_bytes",
    ),
    MetricSpec(
        "obsckpt_saves_in_flight",
        "gauge",
        ("kind",),
        "Saves admitted by the monitor and not yet finished.",
        "saves_in_flight",
    ),
    MetricSpec(
        "obsckpt_thread_join_wait_seconds",
        "histogram",
        ("slot",),
        "Time a new save waited for the previous save of the same slot to finish.",
        "join_wait",
    ),
    MetricSpec(
        "obsckpt_last_thread_join_wait_seconds",
        "gauge",
        ("slot",),
        "The last thread-join wait reported for the slot (by any rank), kept until the next: "
        "obsckpt_thread_join_wait_seconds's last observation.",
        "last_join_wait",
        last_of="join_wait",
    ),
    MetricSpec(
        "obsckpt_save_admission_wait_seconds",
        "histogram",
        ("strategy",),
        "Time a save waited for admission under the save strategy.",
        "admission_wait",
    ),
    MetricSpec(
        "obsckpt_last_save_admission_wait_seconds",
        "gauge",
        ("strategy",),
        "The last admission wait (of any rank's save), kept until the next: "
        "obsckpt_save_admission_wait_seconds's last observation.",
        "last_admission_wait",
        last_of="admission_wait",
    ),
    MetricSpec(
        "obsckpt_commit_lag_seconds",
        "histogram",
        ("kind",),
        "From a step's first save start (for a full checkpoint, its state-dict saves' too) to "
        "its iteration file being committed; a full checkpoint's commit is observed for both "
        "kinds when it moves both iteration files.",
        "commit_lag",
    ),
    MetricSpec(
        "obsckpt_last_commit_lag_seconds",
        "gauge",
        ("kind",),
        "Commit lag of the last commit that moved the kind's iteration file, kept until the "
        "next: obsckpt_commit_lag_seconds's last observation.",
        "last_commit_lag",
        last_of="commit_lag",
    ),
    MetricSpec(
        "obsckpt_latest_step",
        "gauge",
        ("kind",),
        "Step named by the iteration file (latest committed step).",
        "latest_step",
    ),
    MetricSpec(
        "obsckpt_last_commit_timestamp_seconds",
        "gauge",
        ("kind",),
        "Unix time of the last commit; 0 before the job's first commit. A monitor that Ray "
        "restarted takes it from the iteration file.",
        "last_commit_timestamp",
    ),
    MetricSpec(
        "obsckpt_pending_steps",
        "gauge",
        ("kind",),
        "Steps with saves started, registered or submitted that are not committed, failed or superseded.",
        "pending_steps",
    ),
    MetricSpec(
        "obsckpt_oldest_pending_step_start_timestamp_seconds",
        "gauge",
        ("kind",),
        "Unix time the oldest pending step's first save started; 0 when nothing is pending.",
        "oldest_pending_start",
    ),
    MetricSpec(
        "obsckpt_abandoned_steps",
        "gauge",
        (),
        "Steps that will never commit: found on disk uncommitted when the monitor started, "
        "open when it restarted (their saves were registered with its previous incarnation), "
        "or still open when a later step was committed (of those at or below the committed "
        "steps, the 64 newest).",
        "abandoned_steps",
    ),
    MetricSpec(
        "obsckpt_monitor_shutdown_timestamp_seconds",
        "gauge",
        (),
        "Unix time the monitor was shut down cleanly (its shutdown() RPC, at the end of a "
        "job); 0 while it runs. Served in one last scrape before the monitor withdraws its "
        "target, so ObsckptMonitorDown tells a finished job from a lost monitor.",
        "shutdown_timestamp",
    ),
    MetricSpec(
        "obsckpt_step_failures_total",
        "counter",
        ("kind",),
        "Steps that will never commit because they failed: a failed save, a failed commit, "
        "parts that disagree, more saves finished than registered, or (for a full checkpoint) "
        "its state dict failing.",
        "step_failures",
    ),
    MetricSpec(
        "obsckpt_rank_last_save_duration_seconds",
        "gauge",
        ("rank", "slot"),
        "Duration of each rank's last save per slot (find the slowest ranks). A rank's "
        "series go when its process is known gone (a save's lease expired or its node "
        "died, and no other process reported as that rank since) and, for one slot, when "
        "a save of it made of one part per rank names a smaller world (parts).",
        "rank_last_save_duration",
    ),
    MetricSpec(
        "obsckpt_staging_bytes",
        "gauge",
        ("rank", "slot"),
        "Host memory held by a slot's staging buffers in each worker process "
        "(one arena per slot and rank; 0 after close), sent by the workers when it changes. "
        "A rank's series go as obsckpt_rank_last_save_duration_seconds's do.",
        "staging_bytes",
    ),
    MetricSpec(
        "obsckpt_staging_pinned_bytes",
        "gauge",
        ("rank", "slot"),
        "Of obsckpt_staging_bytes, the page-locked (CUDA-registered) bytes.",
        "staging_pinned_bytes",
    ),
    MetricSpec(
        "obsckpt_staging_cold_saves_total",
        "counter",
        ("slot",),
        "Saves that allocated their slot's staging on the caller's path (no prepare() "
        "for these shapes): their stall includes the allocation and page faults.",
        "staging_cold_saves",
    ),
    MetricSpec(
        "obsckpt_slot_label_overflows_total",
        "counter",
        (),
        f'Finished saves and staging reports recorded under slot="{OVERFLOW_SLOT}": their '
        "slot was not among the first max_slot_labels distinct slots the monitor saw (slot "
        "names that carry a step or a time do this). The first such slot is logged by name.",
        "slot_label_overflows",
    ),
    MetricSpec(
        "obsckpt_broadcast_duration_seconds",
        "histogram",
        ("backend", "method"),
        "Time one weight sync from trainer rank 0 to the rollout side took "
        "(a broadcast, or a colocated handover of CUDA IPC / shared-memory buffers).",
        "broadcast_duration",
    ),
    MetricSpec(
        "obsckpt_last_broadcast_duration_seconds",
        "gauge",
        ("backend", "method"),
        "Duration of the last weight sync, kept until the next: "
        "obsckpt_broadcast_duration_seconds's last observation.",
        "last_broadcast_duration",
        last_of="broadcast_duration",
    ),
    MetricSpec(
        "obsckpt_broadcast_bytes_total",
        "counter",
        ("backend", "method"),
        "Bytes sent by weight syncs.",
        "broadcast_bytes",
    ),
    MetricSpec(
        "obsckpt_last_broadcast_bytes",
        "gauge",
        ("backend", "method"),
        "Bytes sent by the last weight sync, kept until the next: "
        "obsckpt_broadcast_bytes_total's last increment.",
        "last_broadcast_bytes",
        last_of="broadcast_bytes",
    ),
    MetricSpec(
        "obsckpt_broadcast_failures_total",
        "counter",
        ("backend", "method", "reason"),
        "Weight syncs that raised: a peer died, stalled past the timeout or broke the "
        "protocol. The group is then broken and a new one must be formed.",
        "broadcast_failures",
    ),
    MetricSpec(
        "obsckpt_weight_sync_phase_seconds",
        "histogram",
        ("method", "sync_phase"),
        "Time each phase of a delta-capable weight sync took on the sender: snapshot (the "
        "host copy the next delta is taken against), encode, wire, verify (the digests); "
        "apply is the slowest receiver's.",
        "weight_sync_phase",
    ),
    MetricSpec(
        "obsckpt_last_weight_sync_phase_seconds",
        "gauge",
        ("method", "sync_phase"),
        "obsckpt_weight_sync_phase_seconds's last observation, kept until the next.",
        "last_weight_sync_phase",
        last_of="weight_sync_phase",
    ),
    MetricSpec(
        "obsckpt_weight_sync_sent_bytes_total",
        "counter",
        ("method", "encoding"),
        "Bytes of weights a delta-capable sync sent (encoding: full, or delta: only the "
        "values that changed since the version the receivers hold).",
        "weight_sync_sent_bytes",
    ),
    MetricSpec(
        "obsckpt_last_weight_sync_sent_bytes",
        "gauge",
        ("method", "encoding"),
        "Bytes the last sync sent, kept until the next: "
        "obsckpt_weight_sync_sent_bytes_total's last increment.",
        "last_weight_sync_sent_bytes",
        last_of="weight_sync_sent_bytes",
    ),
    MetricSpec(
        "obsckpt_weight_sync_state_bytes_total",
        "counter",
        ("method", "encoding"),
        "The whole state's bytes, for each sync: what a full sync would have sent.",
        "weight_sync_state_bytes",
    ),
    MetricSpec(
        "obsckpt_last_weight_sync_state_bytes",
        "gauge",
        ("method", "encoding"),
        "The whole state's bytes at the last sync (obsckpt_last_weight_sync_sent_bytes "
        "over it is the fraction sent).",
        "last_weight_sync_state_bytes",
        last_of="weight_sync_state_bytes",
    ),
    MetricSpec(
        "obsckpt_weight_sync_changed_fraction",
        "gauge",
        ("method",),
        "Fraction of the weights' values that changed at the last delta sync.",
        "weight_sync_changed_fraction",
    ),
    MetricSpec(
        "obsckpt_rollout_pause_seconds",
        "histogram",
        ("method",),
        "How long the slowest receiver was inside one sync (from its start to its weights "
        "applied and verified): the rollout's pause.",
        "rollout_pause",
    ),
    MetricSpec(
        "obsckpt_last_rollout_pause_seconds",
        "gauge",
        ("method",),
        "obsckpt_rollout_pause_seconds's last observation, kept until the next.",
        "last_rollout_pause",
        last_of="rollout_pause",
    ),
    MetricSpec(
        "obsckpt_weight_sync_corrupt_total",
        "counter",
        ("method", "check"),
        "Syncs that failed an integrity check on a receiver (check: checksum, a chunk's "
        "CRC32 before the apply; digest, the weights' CRC32 after it). That receiver keeps "
        "its version and the next sync is a full one.",
        "weight_sync_corrupt",
    ),
    MetricSpec(
        "obsckpt_weight_sync_version_lag",
        "gauge",
        ("method",),
        "After the last sync, how many versions the receiver furthest behind lags the "
        "trainer (0 when every receiver took it).",
        "weight_sync_version_lag",
    ),
    MetricSpec(
        "obsckpt_state_dict_upload_duration_seconds",
        "histogram",
        (),
        "Time one state dict upload to the Synchronizer took.",
        "upload_duration",
    ),
    MetricSpec(
        "obsckpt_last_state_dict_upload_duration_seconds",
        "gauge",
        (),
        "Duration of the last state dict upload, kept until the next: "
        "obsckpt_state_dict_upload_duration_seconds's last observation.",
        "last_upload_duration",
        last_of="upload_duration",
    ),
    MetricSpec(
        "obsckpt_model_version",
        "gauge",
        ("role",),
        "Model version (training step) held by the trainer and by the rollout side.",
        "model_version",
    ),
    MetricSpec(
        "obsckpt_commit_phase_seconds",
        "histogram",
        ("phase",),
        "Time each phase of a commit took (scan: listing and checking the step's files; "
        "fsync_files; manifest: the manifest renamed in, the step and root fsynced; "
        "rename_iteration: the fence check, the iteration files renamed, the root "
        "fsynced), failed or timed-out phases included.",
        "commit_phase",
    ),
    MetricSpec(
        "obsckpt_last_commit_phase_seconds",
        "gauge",
        ("phase",),
        "Time the phase took in the last commit that ran it, kept until the next: "
        "obsckpt_commit_phase_seconds's last observation.",
        "last_commit_phase",
        last_of="commit_phase",
    ),
    MetricSpec(
        "obsckpt_commit_phase_started_timestamp_seconds",
        "gauge",
        ("phase",),
        "Unix time the commit phase now in progress started; 0 for the other phases and "
        "while no commit runs. time() minus it is how long a hung fsync has been waiting.",
        "commit_phase_started",
    ),
    MetricSpec(
        "obsckpt_monitor_fenced",
        "gauge",
        (),
        "1 once this monitor no longer owns its checkpoint root and commits nothing more: "
        "it was shut down, or its lock file (.obsckpt-monitor.lock) was found replaced or "
        "rewritten by another monitor (a deleted one is made anew while no other monitor "
        "has taken the root), or, on an s3:// root, another monitor moved the root's "
        "pointer to a higher epoch; 0 while it owns the root.",
        "monitor_fenced",
    ),
    MetricSpec(
        "obsckpt_store_request_errors_total",
        "counter",
        ("operation", "code"),
        "Requests of the monitor to an s3:// root's endpoint that failed, by operation (put, "
        "get, head, list, put_if_match, ...) and code: the HTTP status, or timeout / "
        "connection when no answer came. A 404 for an object that is absent and a 412 for a "
        "condition that did not hold are answers, not errors, and are not counted.",
        "store_request_errors",
    ),
    MetricSpec(
        "obsckpt_store_cas_conflicts_total",
        "counter",
        (),
        "Commits on an s3:// root whose compare-and-swap of the pointer or manifest was "
        "raced (412 or 409 ConditionalRequestConflict) and settled by reading the pointer.",
        "store_cas_conflicts",
    ),
    MetricSpec(
        "obsckpt_store_fenced_commits_total",
        "counter",
        (),
        "Commits refused because another monitor took the s3:// root (a higher epoch in its "
        "pointer); nothing of them was committed.",
        "store_fenced_commits",
    ),
    MetricSpec(
        "obsckpt_store_upload_bytes_total",
        "counter",
        ("slot",),
        "Bytes the ranks' saves uploaded to an s3:// root, by slot (as the saves reported).",
        "store_upload_bytes",
    ),
    MetricSpec(
        "obsckpt_store_upload_seconds",
        "histogram",
        ("slot",),
        "Time one save's upload to an s3:// root took, by slot: serialising and sending "
        "every part, and completing the object.",
        "store_upload_seconds",
    ),
    MetricSpec(
        "obsckpt_last_store_upload_seconds",
        "gauge",
        ("slot",),
        "obsckpt_store_upload_seconds's last observation.",
        "store_last_upload_seconds",
        last_of="store_upload_seconds",
    ),
    MetricSpec(
        "obsckpt_mirror_latest_step",
        "gauge",
        ("kind",),
        "Step the monitor's mirror (an s3:// root keeping a copy of a local root's committed "
        "steps; OBSCKPT_MIRROR) has committed, by kind; behind obsckpt_latest_step while a "
        "copy runs or fails; -1 until the mirror holds a step of the kind. Absent without "
        "a mirror.",
        "mirror_latest_step",
    ),
    MetricSpec(
        "obsckpt_mirror_upload_bytes_total",
        "counter",
        (),
        "Bytes the monitor uploaded to its mirror (files an earlier commit of the same step "
        "sent are not sent again).",
        "mirror_upload_bytes",
    ),
    MetricSpec(
        "obsckpt_mirror_copy_seconds",
        "histogram",
        (),
        "Time to copy one committed step to the mirror and commit it there: reading and "
        "checking its files, uploading them, HEAD checks, manifest and pointer.",
        "mirror_copy_seconds",
    ),
    MetricSpec(
        "obsckpt_last_mirror_copy_seconds",
        "gauge",
        (),
        "obsckpt_mirror_copy_seconds's last observation.",
        "last_mirror_copy_seconds",
        last_of="mirror_copy_seconds",
    ),
    MetricSpec(
        "obsckpt_mirror_failures_total",
        "counter",
        (),
        "Steps the monitor failed to copy to its mirror: the store failed (tried again, "
        "backing off), a local file no longer matched its manifest, or another monitor took "
        "the mirror (it copies nothing more). status()['mirror']['error'] says which.",
        "mirror_failures",
    ),
    MetricSpec(
        "obsckpt_node_queries_failed_total",
        "counter",
        (),
        "Times the monitor could not ask Ray which nodes are dead (ray.nodes() raised); "
        "it keeps the dead nodes it knew.",
        "node_query_failures",
    ),
    MetricSpec(
        "obsckpt_leftovers_removed_total",
        "counter",
        (),
        "obsckpt's own temp files and scratch directories of writes cut short, removed by "
        "a monitor at its start.",
        "leftovers_removed",
    ),
    MetricSpec(
        "obsckpt_metrics_connections_rejected_total",
        "counter",
        (),
        "Connections to this /metrics endpoint refused: answered 503 and closed because "
        "as many as it serves at once were open, or left queued because accept() "
        "found the process out of file descriptors (each failed try, retried after a pause "
        "of up to 1 s). Scrapers then see failed scrapes; the first of each minute is logged.",
        "metrics_connections_rejected",
    ),
)

SPANS: tuple[SpanSpec, ...] = (
    SpanSpec(
        "obsckpt.checkpoint", "trainer", "Root of a step's trace: dispatching the step's saves."
    ),
    SpanSpec("obsckpt.save", "worker thread", "One background save of one slot on one rank."),
    SpanSpec(
        "obsckpt.commit", "monitor", "Finalising a whole step and renaming its iteration file."
    ),
    SpanSpec("obsckpt.join_wait", "worker", "Waiting for the previous save of the same slot."),
    SpanSpec(
        "obsckpt.admission_wait",
        "worker thread",
        "Waiting for admission under the save strategy (recorded when it lasts >= 1 ms).",
    ),
    SpanSpec("obsckpt.broadcast", "trainer rank 0 / rollout", "One weight broadcast."),
    SpanSpec(
        "obsckpt.upload",
        "trainer rank 0 / Synchronizer",
        "One state dict upload to the Synchronizer, or one committed state dict it loads.",
    ),
)
