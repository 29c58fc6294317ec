"""``python -m obsckpt``: the ``obsckpt`` command."""

from obsckpt.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
