"""Every entry point that takes a checkpoint root refuses a URL it cannot commit to in
one line, and never takes it for a relative path: ``s3://ckpt/run`` once made a
directory named ``s3:`` in the working directory and committed there, and ``verify``
then called that local copy fine."""

from __future__ import annotations

import io
import os
import types

import pytest

from obsckpt import CheckpointMonitor
from obsckpt.cli import main
from obsckpt.errors import SavePathError, UnsupportedStoreError
from obsckpt.options import MonitorOptions
from obsckpt.store import file_records

URLS = ["s3://ckpt/run", "gs://ckpt/run", "hdfs://namenode/ckpt", "s3a://ckpt/run", "s3:ckpt"]


@pytest.fixture(autouse=True)
def in_empty_dir(tmp_path, monkeypatch):
    """The working directory, checked to be left empty: nothing is taken for a path in it."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    yield
    assert list(work.iterdir()) == []


@pytest.mark.parametrize("url", [u for u in URLS if not u.startswith("s3://")])
def test_the_monitors_options(url):
    with pytest.raises(UnsupportedStoreError) as info:
        MonitorOptions(default_local_dir=url)
    text = str(info.value)
    assert "\n" not in text and f"default_local_dir={url!r}" in text
    assert "/ckpt" in text  # what to give instead


def test_the_monitor_takes_s3_roots_normalised():
    options = MonitorOptions(default_local_dir="s3://ckpt//run/")
    assert options.default_local_dir == "s3://ckpt/run"


def test_get_actor_on_a_foreign_pointer_is_one_line(ray_cluster, namespace, seaweed_server):
    """A root whose pointer object something else wrote is refused, in the caller."""
    import uuid

    from seaweed import BUCKET

    from obsckpt.errors import MonitorCallError
    from obsckpt.store import S3Client

    prefix = f"runs/{uuid.uuid4().hex[:12]}"
    S3Client(BUCKET).put(f"{prefix}/obsckpt-pointer.json", b"not a pointer")
    with pytest.raises(MonitorCallError) as info:
        CheckpointMonitor.get_actor(
            namespace=namespace, default_local_dir=f"s3://{BUCKET}/{prefix}"
        )
    text = str(info.value)
    assert "\n" not in text and "is not an obsckpt pointer" in text and prefix in text


def test_the_verl_trainers_root():
    from obsckpt.integrations.verl_trainer import checkpoint_root

    trainer = types.SimpleNamespace(
        config=types.SimpleNamespace(trainer=types.SimpleNamespace(default_local_dir="gs://b/x"))
    )
    with pytest.raises(UnsupportedStoreError, match=r"trainer\.default_local_dir='gs://b/x'"):
        checkpoint_root(trainer)
    # An s3:// root is the trainer's, given as default_local_dir or (first) default_hdfs_dir.
    trainer.config.trainer.default_local_dir = "s3://ckpt/run/"
    assert checkpoint_root(trainer) == "s3://ckpt/run"
    trainer.config.trainer.default_hdfs_dir = "s3://ckpt/other"
    assert checkpoint_root(trainer) == "s3://ckpt/other"
    trainer.config.trainer.default_hdfs_dir = "hdfs://nn/x"
    with pytest.raises(UnsupportedStoreError, match=r"^trainer\.default_hdfs_dir='hdfs://nn/x'"):
        checkpoint_root(trainer)


def test_trinitys_monitor():
    from obsckpt.integrations.trinity_install import TrinityCheckpointMonitor

    with pytest.raises(UnsupportedStoreError, match="s3://ckpt/run") as info:
        TrinityCheckpointMonitor.get_actor(namespace="n", default_local_dir="s3://ckpt/run")
    assert "local (shared) directory" in str(info.value)
    # What a Trinity config with checkpoint_root_dir: s3://ckpt/run hands the switch: its
    # config check makes the root absolute (<cwd>/s3:/ckpt/run/<project>/<group>/<name>).
    # Taken as a path, that committed into a directory named "s3:".
    mangled = os.path.join(os.getcwd(), "s3://ckpt/run", "proj", "group", "name")
    with pytest.raises(UnsupportedStoreError, match="from checkpoint_root_dir") as info:
        TrinityCheckpointMonitor.get_actor(namespace="n", default_local_dir=mangled)
    assert "local (shared) directory" in str(info.value) and "\n" not in str(info.value)
    assert "OBSCKPT_MIRROR=s3://" in str(info.value)  # how to keep the steps on S3
    assert not os.path.exists("s3:")


@pytest.mark.parametrize("url", URLS)
def test_a_save_path(url, tmp_path):
    with pytest.raises(SavePathError, match="it is a URL"):
        file_records.check_targets(
            [f"{url}/global_step_1/actor/model.pt"], root=str(tmp_path), step=1, slot="model"
        )


@pytest.mark.parametrize(
    "argv",
    [
        ["verify", "gs://ckpt/run"],
        ["repair", "s3://ckpt/run"],
        ["status", "s3:ckpt"],
        ["demo", "--ckpt-dir", "gs://ckpt/run", "--steps", "1"],
    ],
    ids=lambda a: " ".join(a[:2]),
)
def test_the_command_line(argv, capsys):
    out, err = io.StringIO(), io.StringIO()
    assert main(argv, out=out, err=err) == 2
    assert out.getvalue() == ""
    said = err.getvalue() + capsys.readouterr().err  # argparse's usage errors: stderr
    last = said.strip().splitlines()[-1]
    assert "s3:" in last or "gs://" in last
    assert "no such directory" not in last
