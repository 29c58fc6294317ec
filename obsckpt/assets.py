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
from obsckpt.validators import validate_url

# File names under obsckpt/_assets, as exported.
DASHBOARD = "obsckpt-dashboard.json"
RULES = "obsckpt-alerts.yml"
SCRAPE = "prometheus-scrape.yml"
NAMES = (DASHBOARD, RULES, SCRAPE)

# Where the runbook is served, when not in the project's repository: the same
# variable `make dashboards` reads.
RUNBOOK_URL_ENV = "OBSCKPT_RUNBOOK_URL"
_RUNBOOK = re.compile(r"^(\s*runbook_url: )(\S+?)(#\S+)$", re.MULTILINE)


def read(name: str) -> str:
    """The text of one shipped file (one of :data:`NAMES`)."""
    if name not in NAMES:
        raise ValueError(f"no shipped file {name!r}; the files are {', '.join(NAMES)}")
    return resources.files("obsckpt").joinpath("_assets", name).read_text(encoding="utf-8")


def runbook_url(value: str | None = None, default: str | None = None) -> str | None:
    """The runbook's URL: ``value``, else $OBSCKPT_RUNBOOK_URL, else ``default``.

    Raises:
        ValueError: the URL chosen is not absolute.
    """
    url = value or os.environ.get(RUNBOOK_URL_ENV) or default
    if url is not None:
        try:
            validate_url(url, "the runbook URL")
        except ValueError as exc:
            raise ValueError(
                f"{exc}. It must be absolute: Alertmanager and Grafana show it as a link; "
                f"set {RUNBOOK_URL_ENV} or pass --runbook-url with where docs/runbook.md is served"
            ) from None
    return url


def with_runbook(rules: str, url: str) -> str:
    """``rules`` with every alert's runbook_url pointing into ``url`` (anchors kept)."""
    return _RUNBOOK.sub(lambda m: f"{m.group(1)}{url}{m.group(3)}", rules)


def export(directory: str | os.PathLike[str], runbook_link: str | None = None) -> list[Path]:
    """Write the shipped files into ``directory`` (made if missing); returns their paths.

    Args:
        directory: where to write.
        runbook_link: absolute URL of docs/runbook.md for the rules' runbook links;
            default $OBSCKPT_RUNBOOK_URL, else the links the rules were built with.

    Raises:
        CliError: ``directory`` is a file, or the runbook URL is not absolute.
    """
    target = Path(directory)
    if target.exists() and not target.is_dir():
        raise CliError(f"{target} is a file; give a directory to write the files into")
    try:
        url = runbook_url(runbook_link)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    texts = {name: read(name) for name in NAMES}
    if url is not None:
        texts[RULES] = with_runbook(texts[RULES], url)
    target.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in texts.items():
        path = target / name
        path.write_text(text, encoding="utf-8")
        written.append(path)
    return written
