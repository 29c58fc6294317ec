"""``python -m obsckpt.trinity``: Trinity-RFT's own CLI, checkpointing through obsckpt.

Takes the place of the ``trinity`` command with the same arguments, e.g.::

    python -m obsckpt.trinity run --config my_config.yaml

It adds obsckpt's Trinity plugin (:data:`obsckpt.integrations.trinity_install.PLUGIN_DIR`)
to ``TRINITY_PLUGIN_DIRS`` and to a ``--plugin-dir`` given (your own plugin
directories stay) and runs Trinity's launcher. ``python -m obsckpt.trinity --plugin-dir-path`` prints
that directory, for ``trinity run --plugin-dir`` or a container's environment.
See docs/integrations.md.
"""

from __future__ import annotations

import os
import sys

PLUGIN_DIRS_VARIABLE = "TRINITY_PLUGIN_DIRS"  # Trinity-RFT's name for it


def with_obsckpt_plugin(value: str | None) -> str:
    """``TRINITY_PLUGIN_DIRS`` with obsckpt's plugin directory added (first, once)."""
    from obsckpt.integrations.trinity_install import PLUGIN_DIR

    dirs = [d for d in (value or "").split(os.pathsep) if d and d != PLUGIN_DIR]
    return os.pathsep.join([PLUGIN_DIR, *dirs])


def main(argv: list[str] | None = None) -> None:
    """Run Trinity's launcher on ``argv`` (default: this process's) with obsckpt's plugin."""
    args = sys.argv[1:] if argv is None else argv
    if args == ["--plugin-dir-path"]:
        from obsckpt.integrations.trinity_install import PLUGIN_DIR

        print(PLUGIN_DIR)
        return
    os.environ[PLUGIN_DIRS_VARIABLE] = with_obsckpt_plugin(os.environ.get(PLUGIN_DIRS_VARIABLE))
    args = _with_plugin_option(args)
    try:
        from trinity.cli.launcher import main as trinity_main  # type: ignore[import-not-found]
    except ImportError as exc:
        raise SystemExit(
            f"python -m obsckpt.trinity runs Trinity-RFT's CLI, which is not importable here "
            f"({exc}); install it (pip install trinity-rft) in this environment"
        ) from None
    sys.argv = ["trinity", *args]
    trinity_main()


def _with_plugin_option(args: list[str]) -> list[str]:
    """``args`` with obsckpt's directory added to a ``--plugin-dir`` given (Trinity's
    launcher replaces ``TRINITY_PLUGIN_DIRS`` with that option's value)."""
    out = list(args)
    for i, arg in enumerate(out):
        if arg == "--plugin-dir" and i + 1 < len(out):
            out[i + 1] = with_obsckpt_plugin(out[i + 1])
        elif arg.startswith("--plugin-dir="):
            out[i] = "--plugin-dir=" + with_obsckpt_plugin(arg.split("=", 1)[1])
    return out


if __name__ == "__main__":
    main()
