"""Reading a monitor's /metrics in tests: samples keyed by (name, sorted label items);
and a local port where nothing listens."""

from __future__ import annotations

import socket
import urllib.request

import ray
from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, tuple], float]


def samples(text: str) -> Samples:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def scrape(monitor) -> Samples:
    """One scrape of the monitor actor's /metrics endpoint."""
    address = ray.get(monitor.metrics_address.remote())
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
    return samples(text)


def value(found: Samples, name: str, **labels: str) -> float | None:
    return found.get((name, tuple(sorted(labels.items()))))


def closed_port() -> int:
    """A port on 127.0.0.1 that was free a moment ago and where nothing listens: a
    connection is refused at once (a dead scrape target, an exporter's absent collector)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed when the block ends
