"""Both blob stores behind one interface: the local folder and an S3-compatible server
(moto in server mode: real HTTP through boto3), including a review run by a real worker
whose corpus and report live in S3."""

from __future__ import annotations

import contextlib
import errno
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import Processes, answers, free_port, wait_until
from runtime_site.blobstore import BlobNotFound, BlobStoreUnavailable, LocalBlobStore, S3BlobStore
from tasks_app.access import console
from tasks_app.actions import do_create_task
from tasks_app.agents.document_review.corpus import generate_corpus
from tasks_app.faults import infrastructure_fault
from tasks_app.models import Task

S3_ENV = {
    "RUNTIME_S3_BUCKET": "runtime-test",
    "RUNTIME_S3_ACCESS_KEY_ID": "test",
    "RUNTIME_S3_SECRET_ACCESS_KEY": "test",
    "RUNTIME_S3_REGION": "us-east-1",
}


@pytest.fixture
def s3(processes: Processes) -> tuple[S3BlobStore, dict[str, str]]:
    port = free_port()
    processes.start("moto", [str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1", "-p", str(port)])
    endpoint = f"http://127.0.0.1:{port}"
    wait_until(lambda: answers(endpoint), timeout=30, what="the S3 server")
    env = {**S3_ENV, "RUNTIME_S3_ENDPOINT_URL": endpoint}
    store = S3BlobStore(
        env["RUNTIME_S3_BUCKET"],
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id="test",
        aws_secret_access_key="test",
    )
    store.client.create_bucket(Bucket=env["RUNTIME_S3_BUCKET"])
    return store, env


@pytest.fixture(params=["local", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path):
    if request.param == "local":
        return LocalBlobStore(tmp_path / "blobs")
    return request.getfixturevalue("s3")[0]


def test_a_store_round_trips_lists_and_refuses_bad_keys(store):
    ref = store.put("a/b/one.json", b'{"x": 1}', "application/json")
    store.put("a/b/two.txt", b"two")
    store.put("a/c/three.txt", b"three")
    assert ref.endswith("a/b/one.json") and ref.split("://")[0] in ("file", "s3")
    assert store.get("a/b/one.json") == b'{"x": 1}'
    assert store.list("a/b") == ["a/b/one.json", "a/b/two.txt"]
    assert store.exists("a/c/three.txt") and not store.exists("a/c/none.txt")
    with pytest.raises(BlobNotFound):
        store.get("a/missing")
    for bad in ("../etc/passwd", "/abs", "a//b", ""):
        with pytest.raises(ValueError, match="invalid blob key"):
            store.put(bad, b"x")


@pytest.mark.django_db(transaction=True)
def test_a_worker_on_the_s3_profile_reads_its_corpus_from_and_writes_its_report_to_s3(alice, s3, processes):
    store, env = s3
    generate_corpus(store, "corpora/s3", 40, 3, "2026-11-01")
    # Publishing without an approval gate here (approvals have their own tests).
    processes.worker(**env, SECURITY_REQUIRE_APPROVAL="payment.create")
    task, _ = do_create_task(
        console(alice.tenant, "user:test"),
        agent="document_review",
        input={"corpus": "corpora/s3", "batchSize": 10, "publish": True},
    )
    wait_until(lambda: Task.objects.get(id=task.id).is_terminal, timeout=60, what="the review to finish")
    task.refresh_from_db()
    assert task.status == "completed", task.error
    report_ref = task.result["report"]["json"]
    assert report_ref.startswith("s3://runtime-test/")
    report = json.loads(store.get(report_ref.removeprefix("s3://runtime-test/")))
    assert report["summary"]["documentsReviewed"] == 40
    published = task.result["published"]["ref"]
    assert published == f"s3://runtime-test/published/{task.id}/report.md"
    assert store.get(published.removeprefix("s3://runtime-test/")).decode().startswith("#")


class SmallDisk:
    """A tmpfs of its own, a few pages big, mounted over a folder: a disk that really fills
    (ENOSPC) and really turns read-only (EROFS, by a remount), as the kernel says so. Needs
    the right to mount (root, as the private PostgreSQL's runuser does)."""

    def __init__(self, folder: Path, size: str = "256k") -> None:
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        mounted = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
            check=False,
            capture_output=True,
            text=True,
        )
        if mounted.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")

    def fill(self) -> None:
        """Every block taken, by a file of its own (removed by `free`)."""
        with contextlib.suppress(OSError), (self.folder / "filler").open("wb") as filler:
            while True:
                filler.write(b"x" * 4096)
                filler.flush()

    def free(self) -> None:
        (self.folder / "filler").unlink(missing_ok=True)

    def remount(self, mode: str) -> None:
        subprocess.run(["mount", "-o", f"remount,{mode}", str(self.folder)], check=True, capture_output=True)

    def unmount(self) -> None:
        subprocess.run(["umount", "-l", str(self.folder)], check=False, capture_output=True)


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[SmallDisk]:
    disk = SmallDisk(tmp_path / "blobs")
    try:
        yield disk
    finally:
        disk.unmount()


def test_a_local_folder_whose_disk_refuses_a_write_is_unavailable_not_the_callers_error(small_disk: SmallDisk):
    """A full disk (ENOSPC) or one turned read-only (EROFS) under the local store raised the
    bare OSError: a step that wrote a blob failed its task for the disk's sake, and the API
    answered a 500. It is the store's unavailability, an infrastructure fault (a delay, a
    503), and once the disk takes writes again the same put succeeds, no half blob left."""
    store = LocalBlobStore(small_disk.folder)
    store.put("reports/before.json", b"{}")

    small_disk.fill()
    with pytest.raises(BlobStoreUnavailable) as full:
        store.put("reports/one.json", b"y" * 65536)
    assert full.value.errno == errno.ENOSPC
    assert infrastructure_fault(full.value) == "the blob store is unavailable (its disk is full)"
    assert not store.exists("reports/one.json") and store.list("reports") == ["reports/before.json"]
    small_disk.free()
    store.put("reports/one.json", b"y" * 65536)
    assert store.get("reports/one.json") == b"y" * 65536

    small_disk.remount("ro")
    with pytest.raises(BlobStoreUnavailable) as read_only:
        store.put("reports/two.json", b"z")
    assert read_only.value.errno == errno.EROFS
    assert infrastructure_fault(read_only.value) == "the blob store is unavailable (its disk is read-only)"
    assert store.get("reports/one.json") == b"y" * 65536  # reads go on
    small_disk.remount("rw")
    store.put("reports/two.json", b"z")
    assert store.get("reports/two.json") == b"z"

    # What is the caller's stays the caller's: a key never written, a bad key.
    with pytest.raises(BlobNotFound):
        store.get("reports/none.json")
    assert infrastructure_fault(BlobNotFound("reports/none.json")) is None
