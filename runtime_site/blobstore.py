"""The blob store: a local folder by default, any S3-compatible store when configured.

Keys are slash-separated relative paths ("corpora/demo/doc-00001.json"); references
handed out to clients are "file://<key>" or "s3://<bucket>/<key>".
"""

from __future__ import annotations

import contextlib
import errno
import functools
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

from django.conf import settings


class BlobStore(Protocol):
    def put(self, key: str, data: bytes, content_type: str = "application/octet-stream") -> str: ...
    def get(self, key: str) -> bytes: ...
    def list(self, prefix: str) -> list[str]: ...
    def exists(self, key: str) -> bool: ...
    def ref(self, key: str) -> str: ...


class BlobNotFound(KeyError):
    pass


class BlobStoreUnavailable(OSError):
    """The store cannot take or give blobs now, for its own reasons, not the key's: an
    infrastructure fault (tasks_app.faults), a delay, never the caller's error."""


# The disk under the local store refusing, in words for the caller: for as long as it is
# full or read-only, not for this blob's sake; the same put succeeds once it is freed.
_DISK_FAULTS = {
    errno.ENOSPC: "its disk is full",
    errno.EDQUOT: "its disk quota is used up",
    errno.EROFS: "its disk is read-only",
    errno.EIO: "its disk had an I/O error",
    errno.EACCES: "its folder may not be written",
}


@contextlib.contextmanager
def _disk_faults(key: str) -> Iterator[None]:
    try:
        yield
    except OSError as exc:
        if (why := _DISK_FAULTS.get(exc.errno or 0)) is None:
            raise
        raise BlobStoreUnavailable(exc.errno, f"the blob store is unavailable ({why})", key) from exc


def _check_key(key: str) -> str:
    parts = key.split("/")
    if not key or key.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"invalid blob key {key!r}")
    return key


class LocalBlobStore:
    def __init__(self, root: Path) -> None:
        self.root = root

    def put(self, key: str, data: bytes, content_type: str = "application/octet-stream") -> str:
        path = self.root / _check_key(key)
        tmp = path.with_name(path.name + ".tmp")
        with _disk_faults(key):
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp.write_bytes(data)
                tmp.replace(path)  # readers never see half a blob
            except OSError:
                # Half a blob on a full disk keeps it full: the retry needs its room back.
                with contextlib.suppress(OSError):
                    tmp.unlink(missing_ok=True)
                raise
        return self.ref(key)

    def get(self, key: str) -> bytes:
        try:
            with _disk_faults(key):
                return (self.root / _check_key(key)).read_bytes()
        except FileNotFoundError as exc:
            raise BlobNotFound(key) from exc

    def list(self, prefix: str) -> list[str]:
        base = self.root / _check_key(prefix.rstrip("/"))
        if not base.is_dir():
            return []
        return sorted(
            str(p.relative_to(self.root)) for p in base.rglob("*") if p.is_file() and not p.name.endswith(".tmp")
        )

    def exists(self, key: str) -> bool:
        return (self.root / _check_key(key)).is_file()

    def ref(self, key: str) -> str:
        return f"file://{key}"


class S3BlobStore:
    def __init__(self, bucket: str, **client_kwargs: str | None) -> None:
        import boto3
        from botocore.config import Config

        # Most S3-compatible servers reject botocore's default CRC checksums (STACK-NOTES §4.2).
        config = Config(
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
            s3={"addressing_style": "path"},
        )
        self.bucket = bucket
        self.client = boto3.client("s3", config=config, **{k: v for k, v in client_kwargs.items() if v})

    def put(self, key: str, data: bytes, content_type: str = "application/octet-stream") -> str:
        self.client.put_object(Bucket=self.bucket, Key=_check_key(key), Body=data, ContentType=content_type)
        return self.ref(key)

    def get(self, key: str) -> bytes:
        try:
            return self.client.get_object(Bucket=self.bucket, Key=_check_key(key))["Body"].read()
        except self.client.exceptions.NoSuchKey as exc:
            raise BlobNotFound(key) from exc

    def list(self, prefix: str) -> list[str]:
        keys: list[str] = []
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix):
            keys.extend(obj["Key"] for obj in page.get("Contents", []))
        return sorted(keys)

    def exists(self, key: str) -> bool:
        from botocore.exceptions import ClientError

        try:
            self.client.head_object(Bucket=self.bucket, Key=_check_key(key))
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return False
            raise
        return True

    def ref(self, key: str) -> str:
        return f"s3://{self.bucket}/{key}"


@functools.cache
def blob_store() -> BlobStore:
    s3 = dict(settings.RUNTIME_S3)
    if bucket := s3.pop("bucket"):
        return S3BlobStore(bucket, **s3)
    return LocalBlobStore(Path(settings.RUNTIME_BLOB_DIR))
