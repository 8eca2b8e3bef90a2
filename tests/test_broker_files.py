"""The embedded default's filesystem broker (runtime_site/brokerfs.py) hands a reader whole
messages only, however a sender's write and a reader's listing interleave."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap

import pytest
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


def test_a_send_that_fails_midway_leaves_no_part_of_its_message_behind(tmp_path):
    """A write that fails partway (here a file size limit; a full disk alike) raised to the
    sender but left its half-written ".part" file in the queue folder, for good: on a full
    disk every retried send kept what it had written, and the disk stayed full."""
    folder = options(tmp_path)
    sender = subprocess.run(
        [
            sys.executable,
            "-c",
            textwrap.dedent(f"""
                import resource, signal
                from kombu import Connection
                from kombu.exceptions import ChannelError
                signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG)
                resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))
                with Connection("filesystem://", transport="runtime_site.brokerfs:Transport",
                                transport_options={folder!r}) as conn:
                    try:
                        conn.SimpleQueue("steps").put({{"pad": "x" * {SIZE}}})
                    except ChannelError:
                        print("refused")
            """),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert sender.stdout.strip() == "refused", sender.stderr
    assert not list((tmp_path / "queue").iterdir())


def test_a_reader_that_cannot_take_messages_says_why_instead_of_idling_in_silence(tmp_path):
    """A rename that failed for any reason was read as "another reader took it first": with
    the data folder read-only (a disk that the kernel remounted read-only after an error), a
    worker passed over every message, for ever, and logged nothing. Here the reader runs in a
    mount namespace of its own where the queue folder is read-only."""
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare(1) for a read-only mount of the queue folder")
    folder = options(tmp_path)
    (tmp_path / "queue" / "00000000000000000001_waiting.steps.msg").write_text("{}")  # any file a reader would take
    reader = textwrap.dedent(f"""
        import logging
        from kombu import Connection
        logging.basicConfig(level=logging.WARNING)
        with Connection("filesystem://", transport="runtime_site.brokerfs:Transport",
                        transport_options={folder!r}) as conn:
            queue = conn.SimpleQueue("steps")
            for _ in range(3):  # three polls
                try:
                    queue.get(block=False)
                except queue.Empty:
                    pass
    """)
    queue = folder["data_folder_in"]
    probe = subprocess.run(["unshare", "-rm", "true"], capture_output=True, check=False)
    if probe.returncode != 0:
        pytest.skip(f"no user and mount namespace here: {probe.stderr.decode().strip()}")
    ran = subprocess.run(
        [
            "unshare",
            "-rm",
            "sh",
            "-c",
            'mount --bind "$1" "$1" && mount -o remount,bind,ro "$1" && exec "$2" -c "$3"',
            "sh",
            queue,
            sys.executable,
            reader,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert ran.returncode == 0, ran.stderr
    assert ran.stderr.count("cannot take") == 1, ran.stderr  # said once, not at every poll
    assert "Read-only file system" in ran.stderr, ran.stderr
    assert [p.name for p in (tmp_path / "queue").iterdir()] == ["00000000000000000001_waiting.steps.msg"]
