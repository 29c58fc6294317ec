"""The usage examples in README.md and docs/weight_sync.md run as they are written.

Each example is read from the markdown when the test runs and executed with
``exec``; only what the prose leaves to the user is supplied (the Ray cluster,
a checkpoint root, the weights and step of a fragment). A renamed keyword, a
wrong import, a missing ``await`` or a changed return shape in the code fails
here, so the examples cannot drift from the code.
"""

from __future__ import annotations

import re
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
FENCE = re.compile(r"^```python\n(.*?)^```$", re.S | re.M)


def example(doc: str, marker: str) -> str:
    """The one python block of ``doc`` containing ``marker``, at its own line numbers.

    The lines before the block are left blank, so a traceback names the
    markdown file's line.
    """
    text = (ROOT / doc).read_text()
    found = [m for m in FENCE.finditer(text) if marker in m.group(1)]
    assert len(found) == 1, f"{doc}: {len(found)} python blocks contain {marker!r}, expected 1"
    return "\n" * text.count("\n", 0, found[0].start(1)) + found[0].group(1)


def fill(code: str, old: str, new: str) -> str:
    """Replace what the user supplies; it must appear exactly once where the test expects it."""
    assert code.count(old) == 1, f"the example no longer contains {old!r} once"
    return code.replace(old, new)


def run(code: str, doc: str, namespace: dict[str, Any]) -> dict[str, Any]:
    exec(compile(code, doc, "exec"), namespace)  # noqa: S102 - the documented example
    return namespace


class TestReadmeUsage:
    """README's "Using it" example commits its step: iteration files, manifest and model file."""

    def test_runs_and_commits(self, ray_cluster, namespace, tmp_path, monkeypatch, capsys):
        code = example(doc := "README.md", "CheckpointCoordinator(monitor)")
        root = tmp_path / "ckpt"
        code = fill(code, '"/tmp/obsckpt-example"', repr(str(root)))
        code = fill(code, 'namespace="job"', f"namespace={namespace!r}")
        # The session's cluster stands in for the example's own ray.init().
        monkeypatch.setattr(ray_cluster, "init", lambda *args, **kwargs: None)
        ns: dict[str, Any] = {"__name__": "readme_example"}
        try:
            run(code, doc, ns)
        finally:
            if "coord" in ns:
                ns["coord"].close()
            if "monitor" in ns:
                ray_cluster.kill(ns["monitor"])
        out = capsys.readouterr().out
        assert re.search(r"^metrics at \S+:\d+$", out, re.M), out
        # What the example's last comment says it prints.
        assert "{'checkpoint': 1, 'state_dict': 1}" in out.splitlines()[-1]
        assert (root / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
        assert (root / "latest_state_dict_iteration.txt").read_text().strip() == "1"
        manifest = (root / "global_step_1" / "manifest.json").read_text()
        for name in ("model_world_size_1_rank_0.pt", "optim_world_size_1_rank_0.pt"):
            assert name in manifest
        saved = torch.load(root / "global_step_1/actor/model_world_size_1_rank_0.pt")
        for key, value in ns["model"].state_dict().items():
            assert torch.equal(saved[key], value)


class TestReadmeTrace:
    """README's example makes one trace per step: run as written (its own process, tracing
    to memory), the saves on their background threads and the submission are all in the
    trace of the step's obsckpt.checkpoint span, none a root of its own."""

    def test_one_trace_per_step(self, ray_cluster, namespace, tmp_path):
        import json
        import os
        import subprocess
        import sys

        code = example("README.md", "CheckpointCoordinator(monitor)")
        code = fill(code, '"/tmp/obsckpt-example"', repr(str(tmp_path / "ckpt")))
        code = fill(code, 'namespace="job"', f"namespace={namespace!r}")
        code += (
            "\nimport json\nfrom obsckpt.telemetry import tracing\ncoord.close()\n"
            "ray.kill(monitor)\nprint('SPANS ' + json.dumps(tracing.finished_spans()))\n"
        )
        env = dict(
            os.environ,
            OTEL_TRACES_EXPORTER="memory",
            RAY_ADDRESS=ray_cluster.get_runtime_context().gcs_address,
        )
        done = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=180
        )
        assert done.returncode == 0, done.stderr[-3000:]
        line = next(ln for ln in done.stdout.splitlines() if ln.startswith("SPANS "))
        spans = json.loads(line.removeprefix("SPANS "))
        names = sorted(sp["name"] for sp in spans)
        assert names.count("obsckpt.checkpoint") == 1 and names.count("obsckpt.save") == 2, names
        assert len({sp["trace_id"] for sp in spans}) == 1, spans
        ids = {sp["span_id"] for sp in spans}
        roots = [sp["name"] for sp in spans if sp["parent_span_id"] not in ids]
        assert roots == ["obsckpt.checkpoint"], roots


class TestWeightSyncExamples:
    """docs/weight_sync.md's Synchronizer and broadcast examples deliver the trainer's weights."""

    def test_synchronizer_memory_sync(self, ray_cluster, namespace, tmp_path):
        code = example(doc := "docs/weight_sync.md", "Synchronizer.get_actor(")
        code = fill(code, 'namespace="job"', f"namespace={namespace!r}")
        code = fill(code, 'default_local_dir="/ckpt"', f"default_local_dir={str(tmp_path)!r}")
        weights = {"w": torch.arange(6.0).reshape(2, 3)}
        ns: dict[str, Any] = {"state_dict": dict(weights), "step": 1, "current": 0}
        try:
            run(code, doc, ns)
        finally:
            if "sync" in ns:
                ray_cluster.kill(ns["sync"])
        assert ns["version"] == 1
        assert torch.equal(ns["state_dict"]["w"], weights["w"])
        assert ns["meta"] == [("w", "float32", (2, 3))]

    @pytest.mark.parametrize("receive", ["weights = b.recv()", "b.recv(into="])
    def test_broadcast_two_ranks(self, receive):
        from obsckpt.sync import free_port

        code = example(doc := "docs/weight_sync.md", "WeightBroadcaster(group")
        # The two members are threads of this process holding CPU models: on a machine
        # with CUDA the documented default (NCCL) would put both on one GPU, which NCCL
        # refuses. The lines run on gloo here; test_broadcast covers NCCL across GPUs.
        code = fill(code, "backend=None,", 'backend="gloo",')
        port = free_port()
        models = [torch.nn.Linear(3, 2) for _ in range(2)]
        with torch.no_grad():
            models[0].weight.fill_(7.0)
            models[0].bias.fill_(-1.0)
        results: dict[int, dict[str, Any]] = {}
        errors: list[BaseException] = []

        def member(rank: int) -> None:
            # The sender runs the lines for rank 0; the receiver one of the two recv forms.
            lines = [
                line
                if ("b.recv(" not in line and "b.send(" not in line)
                or (rank == 0 and "b.send(" in line)
                or (rank == 1 and receive in line)
                else ""
                for line in code.splitlines()
            ]
            ns: dict[str, Any] = {
                "addr": "127.0.0.1",
                "port": port,
                "r": rank,
                "n_rollout": 1,
                "monitor": None,
                "model": models[rank],
                "step": 1,
            }
            try:
                results[rank] = run("\n".join(lines), doc, ns)
            except BaseException as exc:  # noqa: BLE001 - raised on the test's thread
                errors.append(exc)
            finally:
                if "group" in ns:
                    ns["group"].close()

        threads = [threading.Thread(target=member, args=(rank,)) for rank in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        if errors:
            raise errors[0]
        assert sorted(results) == [0, 1]
        sent = models[0].state_dict()
        got = results[1]["weights"] if "weights" in results[1] else models[1].state_dict()
        assert sorted(got) == sorted(sent)
        for key, value in sent.items():
            assert torch.equal(got[key], value)
