"""An independent SMTP server (aiosmtpd) that appends every message it accepts to a file:
the mail the email.send tool really delivered, counted outside our tables.

    python tests/smtp_sink.py --port 8025 --out /tmp/mail.jsonl
"""

from __future__ import annotations

import argparse
import json
import threading
from pathlib import Path

from aiosmtpd.controller import Controller


class Recorder:
    def __init__(self, out: Path) -> None:
        self.out, self.lock = out, threading.Lock()

    async def handle_DATA(self, server, session, envelope) -> str:  # noqa: N802 (aiosmtpd's hook name)
        text = envelope.content.decode("utf8", errors="replace")
        headers = dict(line.split(": ", 1) for line in text.split("\r\n\r\n")[0].split("\r\n") if ": " in line)
        with self.lock, self.out.open("a") as f:
            f.write(
                json.dumps(
                    {"to": envelope.rcpt_tos, "key": headers.get("Idempotency-Key"), "subject": headers.get("Subject")}
                )
                + "\n"
            )
        return "250 Message accepted for delivery"


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    options = parser.parse_args()
    options.out.touch()
    controller = Controller(Recorder(options.out), hostname="127.0.0.1", port=options.port)
    controller.start()
    threading.Event().wait()
