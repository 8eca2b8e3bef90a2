"""The embedded default's filesystem broker (runtime_site/brokerfs.py) hands a reader whole
messages only, however a sender's write and a reader's listing interleave."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from kombu import Connection

from conftest import ROOT

COUNT, SIZE = 40, 2_000_000  # big enough that writing one takes longer than a reader's listing


def options(folder):
    for sub in ("queue", "processed", "control"):
        (folder / sub).mkdir(parents=True, exist_ok=True)
    return {
        "data_folder_in": str(folder / "queue"),
        "data_folder_out": str(folder / "queue"),
        "control_folder": str(folder / "control"),
        "processed_folder": str(folder / "processed"),
        "polling_interval": 0.01,
    }


def test_a_reader_racing_a_sender_gets_every_message_whole_and_in_order(tmp_path):
    folder = options(tmp_path)
    sender = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(f"""
                from kombu import Connection
                with Connection("filesystem://", transport="runtime_site.brokerfs:Transport",
                                transport_options={folder!r}) as conn:
                    queue = conn.SimpleQueue("steps")
                    for n in range({COUNT}):
                        queue.put({{"n": n, "pad": "x" * {SIZE}}})
            """),
        ],
        cwd=ROOT,
    )
    got = []
    with Connection("filesystem://", transport="runtime_site.brokerfs:Transport", transport_options=folder) as conn:
        queue = conn.SimpleQueue("steps")
        while len(got) < COUNT:
            # A read in the middle of a write raised JSONDecodeError here (kombu's own transport).
            message = queue.get(block=True, timeout=60)
            got.append((message.payload["n"], len(message.payload["pad"])))
            message.ack()
    assert sender.wait(timeout=60) == 0
    assert got == [(n, SIZE) for n in range(COUNT)]
    assert not list((tmp_path / "queue").iterdir())  # nothing left behind, no partial files
