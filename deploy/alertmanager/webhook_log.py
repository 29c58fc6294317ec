"""A webhook receiver for Alertmanager that prints each alert as one line.

The compose stack's stand-in for a real receiver (chat, paging): Alertmanager
POSTs its notifications here (deploy/alertmanager/alertmanager.yml) and
``docker compose logs -f alert-webhook`` shows them. Standard library only.
"""

from __future__ import annotations

import json
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

PORT = 9095


class Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # the healthcheck
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"ok\n")

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        try:
            alerts = json.loads(body).get("alerts", [])
        except ValueError:
            self.send_response(400)
            self.end_headers()
            return
        for alert in alerts:
            labels = alert.get("labels", {})
            notes = alert.get("annotations", {})
            print(
                f"{alert.get('status', '?').upper()} {labels.get('alertname', '?')} "
                f"severity={labels.get('severity', '?')} instance={labels.get('instance', '-')}: "
                f"{notes.get('summary', '')} runbook: {notes.get('runbook_url', '-')}",
                flush=True,
            )
        self.send_response(200)
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        pass  # one line per alert, not per request


def main() -> None:
    port = int(sys.argv[1]) if len(sys.argv) > 1 else PORT
    ThreadingHTTPServer(("0.0.0.0", port), Handler).serve_forever()


if __name__ == "__main__":
    main()
