"""The run's last line and its ``--result-json`` file: what ``obsckpt demo`` leaves behind."""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path

from obsckpt.demo.config import DemoResult
from obsckpt.errors import CliError
from obsckpt.store import commit


def finish_line(result: DemoResult) -> str:
    """The demo's last line: how it ended, which steps it trained, what is committed."""
    if result.last_step >= result.first_step:
        trained = f"steps {result.first_step}-{result.last_step}"
        if result.first_step == result.last_step:
            trained = f"step {result.first_step}"
    else:
        trained = "no step trained"
    return (
        f"demo {result.stop_reason}: {trained}, committed checkpoint "
        f"{_or_none(result.committed.get('checkpoint'))}, {result.elapsed_s:.1f} s"
    )


def _or_none(value: int | None) -> str:
    return "none" if value is None else str(value)


def validate_result_json(path: str) -> Path:
    """The absolute --result-json path; CliError when it cannot be written."""
    target = Path(path).expanduser().resolve()
    if target.is_dir():
        raise CliError(f"--result-json {target} is a directory; pass the path of a file")
    if not target.parent.is_dir():
        raise CliError(
            f"--result-json {target}: {target.parent} is not an existing directory; "
            "create it first or pass a path in an existing directory"
        )
    if not os.access(target.parent, os.W_OK | os.X_OK) or (
        target.exists() and not os.access(target, os.W_OK)
    ):
        raise CliError(f"--result-json {target} is not writable by this user")
    return target


def write_result_json(result: DemoResult, path: Path) -> None:
    """Write the run's result as JSON, atomically (a reader never sees half of it)."""
    data = asdict(result)
    if data.get("summary"):
        data["summary"]["rows"] = [asdict(r) for r in result.summary["rows"]]
    commit.atomic_write(path, (json.dumps(data, indent=2, default=str) + "\n").encode())
