"""The monitor and its ranks on several Ray nodes (real raylets on one machine).

The session cluster of the other modules is one node, so every rank there has
the same node id. This module runs its own ``ray.cluster_utils.Cluster`` (a
head and two worker nodes, each with a custom resource to place actors on it),
removes and adds nodes while saves run, and checks what only several nodes
show: admission keyed by node, saves lost with their node, and the monitor
restarted by Ray on another node. The checkpoint root is one local directory,
standing for the job's shared filesystem.

If the session cluster is running when this module starts, it is shut down
first and started again at the end (``conftest.start_session_ray``).
"""

from __future__ import annotations

import time
import urllib.request
import uuid
from dataclasses import dataclass
from typing import Any

import pytest
from conftest import start_session_ray, worker_env
from reliability_helpers import monitor_status, wait_for

from obsckpt import CheckpointMonitor, SaveStrategy
from obsckpt.monitor import ACTOR_NAME
from obsckpt.telemetry.server import read_file_sd_targets

# Ray declares a node dead after this many missed health checks of this period:
# ~1.5 s instead of Ray's default of about 15 s.
_FAST_NODE_DEATH = {
    "health_check_initial_delay_ms": 0,
    "health_check_period_ms": 500,
    "health_check_timeout_ms": 500,
    "health_check_failure_threshold": 3,
}
# Resources per worker node: its own name, and a "mon" slot the monitor is placed by.
_NODES = {"n1": {"n1": 8, "mon": 1}, "n2": {"n2": 8, "mon": 1}}
LEASE_S = 3.0


@dataclass
class MultiNode:
    cluster: Any
    nodes: dict[str, Any]  # name -> ray node handle (the current one after a replace)

    def node_id(self, name: str) -> str:
        return self.cluster.head_node.node_id if name == "head" else self.nodes[name].node_id

    def remove(self, name: str) -> None:
        self.cluster.remove_node(self.nodes.pop(name), allow_graceful=False)

    def add(self, name: str) -> None:
        """Start a new node carrying ``name``'s resources (after :meth:`remove`)."""
        import ray

        self.nodes[name] = self.cluster.add_node(num_cpus=1, resources=_NODES[name])
        self.cluster.wait_for_nodes()
        wait_for(lambda: name in ray.available_resources(), 30, f"node {name} to join")


@pytest.fixture(scope="module")
def multinode():
    import ray
    from ray.cluster_utils import Cluster

    session_was_running = ray.is_initialized()
    if session_was_running:
        ray.shutdown()
    # The workers' variables through the environment every node (started now and when a
    # test adds one back) inherits, not a runtime_env (see start_session_ray).
    env = pytest.MonkeyPatch()
    for name, value in worker_env().items():
        env.setenv(name, value)
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 1,
            "resources": {"head": 8},
            "_system_config": _FAST_NODE_DEATH,
        },
    )
    try:
        nodes = {name: cluster.add_node(num_cpus=1, resources=res) for name, res in _NODES.items()}
        cluster.wait_for_nodes()
        ray.init(address=cluster.address)
        wait_for(lambda: set(_NODES) <= set(ray.available_resources()), 30, "worker nodes")
        yield MultiNode(cluster, nodes)
    finally:
        ray.shutdown()
        cluster.shutdown()
        env.undo()
        if session_was_running:
            start_session_ray()


@pytest.fixture
def ns(multinode):
    """A fresh namespace; nodes a test removed are added back after it."""
    yield f"mn-{uuid.uuid4().hex[:8]}"
    for name in _NODES:
        if name not in multinode.nodes:
            multinode.add(name)


def start_monitor(ns: str, root, strategy: SaveStrategy, *, on: str = "head", **kwargs) -> Any:
    """The job's monitor, as ``CheckpointMonitor.get_actor`` makes it, placed by resource."""
    import ray

    res = {"mon": 1} if on == "mon" else {on: 0.01}
    return (
        ray.remote(CheckpointMonitor)
        .options(
            name=ACTOR_NAME,
            namespace=ns,
            max_restarts=-1,
            max_concurrency=10_000,
            num_cpus=0,
            resources=res,
        )
        .remote(strategy, str(root), None, namespace=ns, **{"lease_timeout_s": LEASE_S, **kwargs})
    )


def rank(ns: str, index: int, node: str) -> Any:
    import ray
    from workers import SaveWorker

    worker = SaveWorker.options(num_cpus=0, resources={node: 0.01}).remote(ns, index)
    ray.get(worker.pid.remote())
    return worker


def status(monitor, timeout: float = 30.0) -> dict:
    """status(), retried while Ray restarts the monitor."""
    return monitor_status(monitor, timeout)


def running(monitor) -> list:
    """Ranks of the saves admitted now."""
    return sorted(t["rank"] for t in status(monitor)["in_flight"] if t["admitted"] is not None)


def node_of(actor) -> str:
    import ray

    return ray.get(actor.__ray_call__.remote(lambda _self: ray.get_runtime_context().get_node_id()))


def commit_step(monitor, root, step: int, ranks: list) -> None:
    import ray

    ray.get(monitor.register_thread_count.remote(step, checkpoint_thread_count=len(ranks)))
    ray.get([r.save.remote(str(root), step, ["model"]) for r in ranks])
    assert ray.get([r.wait.remote(30) for r in ranks]) == [None] * len(ranks)
    ray.get(monitor.monitor_step.remote(step))
    wait_for(lambda: status(monitor)["latest"]["checkpoint"] == step, 20, f"step {step} to commit")


def iteration(root) -> str:
    return (root / "latest_checkpointed_iteration.txt").read_text().strip()


class TestAdmissionByNode:
    """SINGLE_NODE admits saves of one node at a time: saves of the node that saves run
    together, a save of another node waits for them (Trinity-RFT's meaning: one node
    saving at a time). The node id a rank sends is the one Ray reports for its node,
    and SINGLE_PROCESS keys on the node too, so equal pids on two nodes never merge."""

    def test_single_node_serialises_nodes_not_saves(self, multinode, ns, tmp_path):
        import ray

        from obsckpt.monitor_link import ray_identity

        monitor = start_monitor(ns, tmp_path, SaveStrategy.SINGLE_NODE)
        a, b, c = rank(ns, 0, "n1"), rank(ns, 1, "n1"), rank(ns, 2, "n2")
        ident = ray.remote(num_cpus=0)(ray_identity)
        for name in ("n1", "n2"):
            node, _job = ray.get(ident.options(resources={name: 0.01}).remote())
            assert node == multinode.node_id(name)
        assert node_of(a) == multinode.node_id("n1") != node_of(c)

        ray.get(monitor.register_thread_count.remote(1, checkpoint_thread_count=3))
        ray.get(a.save.remote(str(tmp_path), 1, ["model"], gated=True))
        wait_for(lambda: running(monitor) == [0], 10, "rank 0 admitted")
        ray.get(b.save.remote(str(tmp_path), 1, ["optim"], gated=True))
        wait_for(lambda: running(monitor) == [0, 1], 10, "rank 1 (same node) admitted too")
        ray.get(c.save.remote(str(tmp_path), 1, ["model"], gated=True))
        time.sleep(0.5)
        assert running(monitor) == [0, 1] and status(monitor)["admission_waiting"] == 1
        ray.get([a.release.remote("model", 1), b.release.remote("optim", 1)])
        wait_for(lambda: running(monitor) == [2], 10, "rank 2 (other node) admitted")
        ray.get(c.release.remote("model", 1))
        assert ray.get([r.wait.remote(30) for r in (a, b, c)]) == [None] * 3
        ray.get(monitor.monitor_step.remote(1))
        wait_for(lambda: status(monitor)["latest"]["checkpoint"] == 1, 20, "step 1 to commit")
        ray.kill(monitor)

    def test_single_process_same_pid_on_two_nodes(self, multinode, ns, tmp_path):
        import ray

        monitor = start_monitor(ns, tmp_path, SaveStrategy.SINGLE_PROCESS)
        n1, n2 = multinode.node_id("n1"), multinode.node_id("n2")
        first = ray.get(monitor.notify_started.remote(n1, "job", pid=4242))
        second = monitor.notify_started.remote(n2, "job", pid=4242)
        ready, _ = ray.wait([second], timeout=1.0)
        assert not ready, "two processes on two nodes with one pid were admitted together"
        ray.get(monitor.notify_finished.remote(1, ticket=first["ticket"]))
        assert "ticket" in ray.get(second, timeout=10)
        ray.kill(monitor)


class TestRankNodeRemoved:
    """A node removed while its ranks save: the monitor fails the step within the
    lease, releases the admission so other nodes' saves proceed, never commits the
    step; the next step commits on the surviving nodes, and with a node added back."""

    def test_saving_node_removed(self, multinode, ns, tmp_path):
        import ray

        monitor = start_monitor(ns, tmp_path, SaveStrategy.SINGLE_NODE)
        a, lost = rank(ns, 0, "n1"), rank(ns, 1, "n2")
        ray.get(monitor.register_thread_count.remote(1, checkpoint_thread_count=2))
        ray.get(lost.save.remote(str(tmp_path), 1, ["model"], gated=True))
        wait_for(lambda: running(monitor) == [1], 10, "the n2 rank admitted")
        ray.get(a.save.remote(str(tmp_path), 1, ["model"]))
        ray.get(monitor.monitor_step.remote(1))
        removed = time.monotonic()
        multinode.remove("n2")
        st = wait_for(lambda: status(monitor)["failed"] and status(monitor), 3 * LEASE_S, "a fail")
        failed_after = time.monotonic() - removed
        assert [f["step"] for f in st["failed"]] == [1]
        error = st["failed"][0]["error"]  # whichever comes first: the lease or Ray's word
        assert "sent no heartbeat" in error or "a node that Ray reports dead" in error, error
        assert ray.get(a.wait.remote(30)) is None  # admitted once n2's admission was released
        assert status(monitor)["latest"]["checkpoint"] is None
        assert not (tmp_path / "latest_checkpointed_iteration.txt").exists()
        print(f"step failed {failed_after:.1f} s after its node was removed (lease {LEASE_S} s)")

        commit_step(monitor, tmp_path, 2, [a])
        multinode.add("n2")
        commit_step(monitor, tmp_path, 3, [a, rank(ns, 1, "n2")])
        assert iteration(tmp_path) == "3"
        ray.kill(monitor)

    def test_trinity_caller_node_removed(self, multinode, ns, tmp_path):
        """A Trinity-style save (node_id and job_id only: no lease) admitted on a node that
        is removed no longer holds its admission: Ray reports the node dead."""
        import ray

        monitor = start_monitor(ns, tmp_path, SaveStrategy.SINGLE_NODE, lease_timeout_s=None)

        @ray.remote(num_cpus=0)
        class TrinityRank:
            def start(self, monitor) -> dict:
                ctx = ray.get_runtime_context()
                ref = monitor.notify_started.remote(
                    node_id=ctx.get_node_id(), job_id=ctx.get_job_id()
                )
                return ray.get(ref)

        trinity = TrinityRank.options(resources={"n2": 0.01}).remote()
        assert ray.get(trinity.start.remote(monitor))["heartbeat_s"] is None
        a = rank(ns, 0, "n1")
        removed = time.monotonic()
        multinode.remove("n2")
        commit_step(monitor, tmp_path, 1, [a])
        print(f"n1's save admitted and committed {time.monotonic() - removed:.1f} s after n2 left")
        assert status(monitor)["in_flight"] == []
        ray.kill(monitor)


class TestMonitorNodeRemoved:
    """The monitor's node removed: Ray restarts the monitor on another node; it knows
    the committed step from disk, treats a step whose saves it lost as abandoned (never
    committed), serves /metrics there and names that endpoint in file_sd, and the next
    step commits."""

    def test_monitor_restarted_elsewhere(self, multinode, ns, tmp_path):
        import ray

        @ray.remote(num_cpus=0)
        class Holder:
            def ready(self) -> bool:
                return True

        # n2's "mon" slot is taken, so the monitor starts on n1; it is freed for the restart.
        holder = Holder.options(resources={"mon": 1, "n2": 0.01}).remote()
        ray.get(holder.ready.remote())
        sd = tmp_path / "sd.json"
        root = tmp_path / "root"
        monitor = start_monitor(
            ns, root, SaveStrategy.SINGLE_THREAD, on="mon", file_sd_path=str(sd)
        )
        assert node_of(monitor) == multinode.node_id("n1")
        ray.kill(holder)
        a, h = rank(ns, 0, "n2"), rank(ns, 1, "head")
        commit_step(monitor, root, 1, [a, h])

        ray.get(monitor.register_thread_count.remote(2, checkpoint_thread_count=2))
        ray.get(a.save.remote(str(root), 2, ["model"], gated=True))
        wait_for(lambda: running(monitor) == [0], 10, "rank 0 admitted")
        removed = time.monotonic()
        multinode.remove("n1")
        st = wait_for(lambda: (s := status(monitor))["restarted"] and s, 30, "the restart")
        restarted_after = time.monotonic() - removed
        assert node_of(monitor) == multinode.node_id("n2")
        assert st["latest"] == {"checkpoint": 1, "state_dict": 1}
        assert st["last_commit_time"]["checkpoint"] is not None
        assert st["in_flight"] == [] and st["pending"] == []
        address = ray.get(monitor.metrics_address.remote())
        ip = next(n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == node_of(monitor))
        assert address.rsplit(":", 1)[0] == ip
        assert read_file_sd_targets(sd) == [address]
        body = urllib.request.urlopen(f"http://{address}/metrics", timeout=5).read().decode()
        assert 'obsckpt_latest_step{kind="checkpoint"} 1.0' in body

        ray.get(a.release.remote("model", 2))  # admitted by the monitor's previous incarnation
        assert ray.get(a.wait.remote(30)) is None
        ray.get(monitor.monitor_step.remote(2))
        wait_for(lambda: [x["step"] for x in status(monitor)["abandoned"]] == [2], 10, "abandon")
        assert iteration(root) == "1"
        commit_step(monitor, root, 3, [a, h])
        assert iteration(root) == "3"
        print(f"monitor restarted on n2 {restarted_after:.1f} s after n1 was removed")
        ray.kill(monitor)
