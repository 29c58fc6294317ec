"""The Grafana dashboard, alert rules and scrape config shipped with this version.

``make dashboards`` generates them from ``dashboards/`` into ``obsckpt/_assets/``
(a test checks they match), so an installed wheel carries the observability
files of its own version; ``obsckpt dashboards export DIR`` writes them out.
"""

from __future__ import annotations

import os
import re
from importlib import resources
from pathlib import Path

from obsckpt.errors import CliError

# File names under obsckpt/_assets, as exported.
DASHBOARD = "obsckpt-dashboard.json"
RULES = "obsckpt-alerts.yml"
SCRAPE = "prometheus-scrape.yml"
NAMES = (DASHBOARD, RULES, SCRAPE)

# Where the runbook is served, when not in the project's repository: the same
# variable `make dashboards` reads.
RUNBOOK_URL_ENV = "OBSCKPT_RUNBOOK_URL"
_RUNBOOK = re.compile(r"^(\s*runbook_url: )(\S+?)(#\S+)$", re.MULTILINE)
_ABSOLUTE = re.compile(r"https?://[^/\s]+\S*")


def read(name: str) -> str:
    """The text of one shipped file (one of :data:`NAMES`)."""
    if name not in NAMES:
        raise ValueError(f"no shipped file {name!r}; the files are {', '.join(NAMES)}")
    return resources.files("obsckpt").joinpath("_assets", name).read_text(encoding="utf-8")


def with_runbook(rules: str, url: str) -> str:
    """``rules`` with every alert's runbook_url pointing into ``url`` (anchors kept)."""
    if not _ABSOLUTE.fullmatch(url):
        raise ValueError(
            f"the runbook URL must be absolute (http:// or https://), got {url!r}: "
            "Alertmanager and Grafana show it as a link"
        )
    return _RUNBOOK.sub(lambda m: f"{m.group(1)}{url}{m.group(3)}", rules)


def export(directory: str | os.PathLike[str], runbook_url: str | None = None) -> list[Path]:
    """Write the shipped files into ``directory`` (made if missing); returns their paths.

    Args:
        directory: where to write.
        runbook_url: absolute URL of docs/runbook.md for the rules' runbook links;
            default $OBSCKPT_RUNBOOK_URL, else the links the rules were built with.

    Raises:
        CliError: ``directory`` is a file, or the runbook URL is not absolute.
    """
    target = Path(directory)
    if target.exists() and not target.is_dir():
        raise CliError(f"{target} is a file; give a directory to write the files into")
    url = runbook_url or os.environ.get(RUNBOOK_URL_ENV)
    texts = {name: read(name) for name in NAMES}
    if url:
        try:
            texts[RULES] = with_runbook(texts[RULES], url)
        except ValueError as exc:
            raise CliError(str(exc)) from None
    target.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in texts.items():
        path = target / name
        path.write_text(text, encoding="utf-8")
        written.append(path)
    return written
