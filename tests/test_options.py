"""MonitorOptions, the OBSCKPT_* reader and lookup_actor: one definition, checked once."""

from __future__ import annotations

import dataclasses
import inspect
import subprocess
import sys

import pytest

from obsckpt import CheckpointMonitor, SaveStrategy
from obsckpt.options import (
    OBSCKPT_FILE_SD_PATH,
    MonitorOptions,
    from_env_if_absent,
)


class TestMonitorOptions:
    """Each invalid field is refused with a ValueError naming the field and its value."""

    @pytest.mark.parametrize(
        ("field", "value"),
        [
            ("metrics_port", 70000),
            ("max_slot_labels", 0),
            ("lease_timeout_s", -1.0),
            ("default_hdfs_dir", "hdfs://x"),
            ("save_strategy", "fast"),
        ],
    )
    def test_a_bad_field_is_named(self, tmp_path, field, value):
        with pytest.raises(ValueError, match=field) as info:
            MonitorOptions(default_local_dir=str(tmp_path), **{field: value})
        assert repr(value) in str(info.value)

    def test_root_is_required(self):
        with pytest.raises(ValueError, match="default_local_dir is required"):
            MonitorOptions(default_local_dir=None)

    def test_frozen_and_normalised(self, tmp_path):
        options = MonitorOptions(default_local_dir=tmp_path, save_strategy="single_node")
        assert options.save_strategy is SaveStrategy.SINGLE_NODE
        assert options.default_local_dir == str(tmp_path)
        with pytest.raises(dataclasses.FrozenInstanceError):
            options.metrics_port = 1  # type: ignore[misc]

    def test_constructor_and_get_actor_share_the_defaults(self):
        """Both signatures' defaults for the options' fields are the dataclass's."""
        defaults = {
            f.name: f.default
            for f in dataclasses.fields(MonitorOptions)
            if f.default is not dataclasses.MISSING
        }
        for fn in (CheckpointMonitor.__init__, CheckpointMonitor.get_actor):
            params = inspect.signature(fn).parameters
            for name, default in defaults.items():
                if name in params:
                    assert params[name].default == default, (fn.__name__, name)

    def test_file_sd_path_from_the_environment(self, tmp_path, monkeypatch):
        monkeypatch.setenv(OBSCKPT_FILE_SD_PATH, str(tmp_path / "sd.json"))
        options = MonitorOptions(default_local_dir=str(tmp_path))
        assert options.resolved_file_sd_path() == str(tmp_path / "sd.json")
        given = MonitorOptions(default_local_dir=str(tmp_path), file_sd_path="/x.json")
        assert given.resolved_file_sd_path() == "/x.json"


class TestFromEnvIfAbsent:
    """The argument, else the variable, else the default; a bad variable is named."""

    def test_order(self, monkeypatch):
        monkeypatch.delenv("OBSCKPT_TEST_VALUE", raising=False)
        assert from_env_if_absent(None, "OBSCKPT_TEST_VALUE", 3.0, float) == 3.0
        monkeypatch.setenv("OBSCKPT_TEST_VALUE", "")
        assert from_env_if_absent(None, "OBSCKPT_TEST_VALUE", 3.0, float) == 3.0
        monkeypatch.setenv("OBSCKPT_TEST_VALUE", "7.5")
        assert from_env_if_absent(None, "OBSCKPT_TEST_VALUE", 3.0, float) == 7.5
        assert from_env_if_absent(1.0, "OBSCKPT_TEST_VALUE", 3.0, float) == 1.0

    def test_a_bad_variable_is_named(self, monkeypatch):
        monkeypatch.setenv("OBSCKPT_TEST_VALUE", "soon")
        with pytest.raises(ValueError, match="OBSCKPT_TEST_VALUE='soon'"):
            from_env_if_absent(None, "OBSCKPT_TEST_VALUE", 3.0, float)


def test_options_imports_neither_torch_nor_ray():
    code = (
        "import sys, obsckpt.options\n"
        "print(sorted(m for m in ('torch', 'ray') if m in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    ).stdout
    assert out.strip() == "[]"
