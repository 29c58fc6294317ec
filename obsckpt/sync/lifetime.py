"""The command that ends a detached Synchronizer::

    python -m obsckpt.sync.lifetime --namespace <ray namespace> [--address auto]

Trinity-RFT 0.6.0's synchronizer is a detached actor (:mod:`obsckpt.sync.detached`):
one created outside an actor tracks no module, and ends with its owner's
``shutdown()`` call or with this command. It answers in one line: what it
ended, or why it could not reach the cluster, after a bounded wait. Nothing
imports this module (so ``python -m`` runs it without runpy's warning about
a module already imported).
"""

from __future__ import annotations

import argparse
import logging
import socket
import sys

from obsckpt.monitor_link import one_line
from obsckpt.sync.detached import stop

# How long the command waits for the cluster's address to answer.
CONNECT_TIMEOUT_S = 10.0
EXIT_UNREACHABLE = 2


def _host_port(address: str) -> tuple[str, int] | None:
    """``host:port`` of a GCS address (``ray://`` and ``auto`` are not checked here)."""
    if "://" in address or address in ("auto", "local"):
        return None
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        return None
    return host.strip("[]") or "127.0.0.1", int(port)


def _unreachable(address: str, timeout_s: float) -> str | None:
    """Why ``address`` does not answer within ``timeout_s`` (None: it does, or is not checked)."""
    target = _host_port(address)
    if target is None:
        return None
    try:
        with socket.create_connection(target, timeout=timeout_s):
            return None
    except TimeoutError:
        return f"no answer in {timeout_s:g} s"
    except OSError as exc:
        return exc.strerror or str(exc)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m obsckpt.sync.lifetime",
        description="End a detached obsckpt Synchronizer (Trinity-RFT 0.6.0's form).",
    )
    parser.add_argument("--namespace", required=True, help="the job's Ray namespace")
    parser.add_argument(
        "--address",
        default="auto",
        help="the Ray cluster: host:port of its head, or auto (RAY_ADDRESS, else the "
        "cluster started on this machine; the default)",
    )
    args = parser.parse_args(argv)
    prog = parser.prog
    why = _unreachable(args.address, CONNECT_TIMEOUT_S)
    if why is not None:
        print(
            f"{prog}: error: cannot reach the Ray cluster at {args.address} ({why}); "
            "check --address (the head node's GCS address, host:port)",
            file=sys.stderr,
        )
        return EXIT_UNREACHABLE
    import ray

    try:
        ray.init(
            address=args.address,
            namespace=args.namespace,
            log_to_driver=False,
            logging_level=logging.ERROR,
        )
    except (ConnectionError, TimeoutError, ValueError) as exc:
        print(
            f"{prog}: error: cannot connect to a Ray cluster ({args.address}): "
            f"{one_line(exc).rstrip('.')}. Start the job's cluster, or name it with --address host:port "
            "or RAY_ADDRESS",
            file=sys.stderr,
        )
        return EXIT_UNREACHABLE
    found = stop(args.namespace)
    print(
        f"synchronizer in namespace {args.namespace!r}: " + ("ended" if found else "none running")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
