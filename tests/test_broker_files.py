"""The embedded default's filesystem broker (runtime_site/brokerfs.py) hands a reader whole
messages only, however a sender's write and a reader's listing interleave."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import time

import pytest
from kombu import Connection

from conftest import ROOT
from runtime_site import brokerfs

COUNT, SIZE = 40, 2_000_000  # big enough that writing one takes longer than a reader's listing


@pytest.fixture(autouse=True)
def fresh_bindings():
    """kombu keeps the queues a process has bound in one state per transport class, across
    connections: a test's folder would then lack the binding an earlier test's folder got,
    and a message put from this process would find no queue."""
    brokerfs.Transport.global_state.clear()


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


def taken_files(tmp_path):
    return sorted(p.name for p in (tmp_path / "queue").iterdir() if p.name.startswith(brokerfs.TAKEN))


def test_a_taken_message_stays_with_its_live_reader_and_goes_back_when_the_reader_dies(tmp_path):
    """At least once: a reader that dies before it acknowledges (SIGKILL mid-task) no longer
    takes the message with it (kombu's transport deleted the file as it read it). Its taken
    file is put back by the next sweep, and only once its reader is gone: the reader's lock
    says so."""
    folder = options(tmp_path)
    with Connection("filesystem://", transport="runtime_site.brokerfs:Transport", transport_options=folder) as conn:
        conn.SimpleQueue("steps").put({"n": 1})
    reader = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(f"""
                import sys
                from kombu import Connection
                with Connection("filesystem://", transport="runtime_site.brokerfs:Transport",
                                transport_options={folder!r}) as conn:
                    message = conn.SimpleQueue("steps").get(block=True, timeout=60)
                    print("taken", message.payload["n"], flush=True)
                    sys.stdin.read()  # holds it, unacknowledged, until killed
            """),
        ],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert reader.stdout is not None and reader.stdout.readline().strip() == "taken 1"
        [taken] = taken_files(tmp_path)
        assert taken.startswith(f"{brokerfs.TAKEN}{reader.pid}-")
        with Connection("filesystem://", transport="runtime_site.brokerfs:Transport", transport_options=folder) as conn:
            queue = conn.SimpleQueue("steps")
            for _ in range(3):
                brokerfs.sweep(folder["data_folder_in"])
                with pytest.raises(queue.Empty):
                    queue.get(block=False)  # a poll, with its own sweep
            assert taken_files(tmp_path) == [taken]  # never stolen from a live reader

            reader.kill()
            reader.wait(timeout=30)
            brokerfs.sweep(folder["data_folder_in"])
            assert taken_files(tmp_path) == []
            message = queue.get(block=True, timeout=10)
            assert message.payload == {"n": 1}
            message.ack()
        assert not list((tmp_path / "queue").iterdir())
    finally:
        if reader.poll() is None:
            reader.kill()
            reader.wait(timeout=30)


def test_a_sweep_in_the_reading_process_leaves_its_own_taken_message_alone(tmp_path):
    """lockf locks belong to the process: a sweep in the reader's own process would get the
    lock of its own message at once, and closing the file it opened for that would drop the
    reader's lock. It skips what its process holds; another process still finds it locked."""
    folder = options(tmp_path)
    with Connection("filesystem://", transport="runtime_site.brokerfs:Transport", transport_options=folder) as conn:
        queue = conn.SimpleQueue("steps")
        queue.put({"n": 2})
        message = queue.get(block=True, timeout=10)
        [taken] = taken_files(tmp_path)
        brokerfs.sweep(folder["data_folder_in"])
        other = subprocess.run(
            [sys.executable, "-c", f"from runtime_site import brokerfs; brokerfs.sweep({folder['data_folder_in']!r})"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=False,
            timeout=60,
        )
        assert other.returncode == 0, other.stderr
        assert taken_files(tmp_path) == [taken], other.stderr
        message.ack()
    assert not list((tmp_path / "queue").iterdir())


def test_a_sweep_removes_the_half_written_files_of_senders_gone_for_five_minutes(tmp_path):
    folder = options(tmp_path)
    queue_folder = tmp_path / "queue"
    old = queue_folder / "00000000000000000001_old.steps.msg.part"
    new = queue_folder / "00000000000000000002_new.steps.msg.part"
    old.write_bytes(b'{"body": "half')
    new.write_bytes(b'{"body": "being writ')
    long_ago = time.time() - brokerfs.PART_MAX_SECONDS - 60
    os.utime(old, (long_ago, long_ago))
    brokerfs.sweep(folder["data_folder_in"])
    assert sorted(p.name for p in queue_folder.iterdir()) == [new.name]  # a live sender's stays
    with Connection("filesystem://", transport="runtime_site.brokerfs:Transport", transport_options=folder) as conn:
        queue = conn.SimpleQueue("steps")
        with pytest.raises(queue.Empty):
            queue.get(block=False)  # no reader takes a half-written file


def test_a_consumer_that_acknowledges_nothing_holds_nothing(tmp_path):
    """A no_ack consumer (Celery's remote control) never acknowledges: held for an ack, each of
    its messages stayed locked on disk for the life of its process. It takes them at most once."""
    folder = options(tmp_path)
    with Connection("filesystem://", transport="runtime_site.brokerfs:Transport", transport_options=folder) as conn:
        queue = conn.SimpleQueue("control", no_ack=True)
        queue.put({"n": 3})
        assert queue.get(block=True, timeout=10).payload == {"n": 3}
        assert not list((tmp_path / "queue").iterdir())


def test_entries_that_are_no_message_files_are_set_aside_and_the_messages_behind_them_delivered(tmp_path):
    """A named pipe in the queue folder failed to open with an OSError, read as "this reader
    cannot take any": its queue was held up for good. A symbolic link to /dev/zero, or a
    file of a terabyte, was read whole into memory, and the MemoryError ended the worker.
    Each is set aside unread. The reader runs with its memory capped, so that a regression
    fails here instead of taking the machine's memory."""
    folder = options(tmp_path)
    queue_folder = tmp_path / "queue"
    os.mkfifo(queue_folder / "00000000000000000001_pipe.steps.msg")
    (queue_folder / "00000000000000000002_link.steps.msg").symlink_to("/dev/zero")
    with open(queue_folder / "00000000000000000003_huge.steps.msg", "wb") as f:
        f.truncate(1 << 40)  # sparse: no disk used
    with Connection("filesystem://", transport="runtime_site.brokerfs:Transport", transport_options=folder) as conn:
        conn.SimpleQueue("steps").put({"n": 4})
    reader = subprocess.run(
        [
            sys.executable,
            "-c",
            textwrap.dedent(f"""
                import resource
                from kombu import Connection
                resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))
                with Connection("filesystem://", transport="runtime_site.brokerfs:Transport",
                                transport_options={folder!r}) as conn:
                    message = conn.SimpleQueue("steps").get(block=True, timeout=10)
                    message.ack()
                    print(message.payload["n"])
            """),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert reader.stdout.strip() == "4", reader.stderr
    assert not list(queue_folder.iterdir())
    assert sorted(p.name for p in (tmp_path / "processed").iterdir()) == [
        f"00000000000000000001_pipe.steps.msg{brokerfs.UNREADABLE}",
        f"00000000000000000002_link.steps.msg{brokerfs.UNREADABLE}",
        f"00000000000000000003_huge.steps.msg{brokerfs.UNREADABLE}",
    ]
    for reason in ("not a regular file", "a symbolic link", "more than any message"):
        assert reason in reader.stderr, reader.stderr


def test_a_copy_of_a_message_being_run_waits_for_it_instead_of_leaving_it_held(tmp_path):
    """Two files with one delivery tag (a message put twice, a set-aside file put back by
    hand twice): the copy, taken while the first was unacknowledged, replaced it in the
    channel's books; acknowledging both left the first's file taken and locked for the life
    of the reader, to run again after it."""
    folder = options(tmp_path)
    queue_folder = tmp_path / "queue"
    with Connection("filesystem://", transport="runtime_site.brokerfs:Transport", transport_options=folder) as conn:
        queue = conn.SimpleQueue("steps")
        queue.put({"n": 5})
        [original] = queue_folder.iterdir()
        shutil.copy(original, queue_folder / original.name.replace("_", "_copy-", 1))
        first = queue.get(block=True, timeout=10)
        with pytest.raises(queue.Empty):
            queue.get(block=False)  # the copy waits for the first
        first.ack()
        copy = queue.get(block=True, timeout=10)
        assert copy.payload == first.payload == {"n": 5}
        copy.ack()
        assert not list(queue_folder.iterdir())


def test_a_reader_whose_queue_folder_is_gone_says_so_and_reads_again_once_it_is_back(tmp_path, caplog):
    """The queue folder removed under a running worker (by hand, or by a cleaner of old files
    under /tmp): the FileNotFoundError out of the listing ended the worker."""
    folder = options(tmp_path)
    with Connection("filesystem://", transport="runtime_site.brokerfs:Transport", transport_options=folder) as conn:
        queue = conn.SimpleQueue("steps")
        shutil.rmtree(tmp_path / "queue")
        for _ in range(3):
            with pytest.raises(queue.Empty):
                queue.get(block=False)
        said = [r.getMessage() for r in caplog.records if "cannot take" in r.getMessage()]
        assert len(said) == 1 and "No such file or directory" in said[0], said  # once, not at every poll
        (tmp_path / "queue").mkdir()
        queue.put({"n": 6})
        message = queue.get(block=True, timeout=10)
        assert message.payload == {"n": 6}
        message.ack()


def test_a_message_set_aside_without_a_processed_folder_is_said_and_done_with(tmp_path, caplog):
    """The processed folder removed by hand (clearing the set-aside files), or a full disk:
    the OSError out of keeping the copy of a message the consumer cannot run (an unknown
    task) ended the worker; its taken file went back at the next sweep and ended the next
    worker. Here the copy is not kept, and that is said; its file in the queue folder goes
    the same way."""
    folder = options(tmp_path)
    (tmp_path / "queue" / "00000000000000000001_junk.steps.msg").write_bytes(b"not JSON")
    with Connection("filesystem://", transport="runtime_site.brokerfs:Transport", transport_options=folder) as conn:
        queue = conn.SimpleQueue("steps")
        shutil.rmtree(tmp_path / "processed")
        queue.channel.set_aside("steps", b'{"headers": {"task": "tasks.no_such_task"}}', "no task")
        assert "no copy of the unreadable message on steps kept" in caplog.text
        queue.put({"n": 7})
        message = queue.get(block=True, timeout=10)
        assert message.payload == {"n": 7}
        message.ack()
    assert "00000000000000000001_junk.steps.msg" in caplog.text
    assert not list((tmp_path / "queue").iterdir())
