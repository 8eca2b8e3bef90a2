"""A task's artifacts, readable by people: the blobs its steps wrote with ctx.artifact
(`tasks/<id>/artifacts/<name>`), served by the REST API (bearer key) and the dashboard
(session), both scoped to the caller's tenant by the task lookup before they get here.

A `file://…` or `s3://…` reference means nothing to a browser; these routes are what a
result's references are shown as. Artifacts are written by agents from tool output, so
what is served is never trusted: sent with nosniff and a sandboxing Content-Security-Policy
(an HTML report cannot run script on our origin), and cut off at `api.max_artifact_bytes`.
"""

from __future__ import annotations

import mimetypes
import re
from typing import Any

from django.conf import settings
from django.http import HttpResponse, JsonResponse

from runtime_site.blobstore import BlobNotFound, blob_store
from tasks_app.models import Task

# One path segment, and never "." or ".." (nor any name starting with a dot): the blob store
# would refuse such a key, and a refusal is a 500, not a "no such artifact".
NAME = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9._-]{0,199}\Z")
TYPES = {
    ".md": "text/markdown; charset=utf-8",
    ".json": "application/json",
    ".txt": "text/plain; charset=utf-8",
    ".csv": "text/csv; charset=utf-8",
}


def prefix(task: Task) -> str:
    return prefix_of(task.id)


def prefix_of(task_id: Any) -> str:
    """Where a task's artifacts live in the blob store: its id is unique across tenants, so the
    prefix is the task's and its tenant's alone."""
    return f"tasks/{task_id}/artifacts/"


def names(task: Task) -> list[str]:
    return sorted(key.rsplit("/", 1)[-1] for key in blob_store().list(prefix(task)))


def name_of(task: Task, ref: Any) -> str | None:
    """The artifact name a result's reference points at (file://… or s3://…), if it is one of this task's."""
    if not isinstance(ref, str):
        return None
    head, _, name = ref.rpartition("/")
    return name if head.endswith(prefix(task).rstrip("/")) and NAME.match(name) else None


def content_type(name: str) -> str:
    suffix = "." + name.rsplit(".", 1)[-1].lower() if "." in name else ""
    return TYPES.get(suffix) or mimetypes.guess_type(name)[0] or "application/octet-stream"


def _error(status: int, code: str, message: str) -> JsonResponse:
    return JsonResponse({"error": {"code": code, "message": message}}, status=status)


def response(task: Task, name: str, *, download: bool = False) -> HttpResponse:
    if not NAME.match(name):
        return _error(404, "not_found", "no such artifact")
    try:
        data = blob_store().get(prefix(task) + name)
    except BlobNotFound:
        return _error(404, "not_found", f"task has no artifact {name!r}")
    limit = int(settings.RUNTIME["api"].get("max_artifact_bytes", 10_485_760))
    if len(data) > limit:
        return _error(
            413,
            "too_large",
            f"artifact {name!r} is {len(data)} bytes; this server serves at most {limit} (api.max_artifact_bytes)",
        )
    answer = HttpResponse(data, content_type=content_type(name))
    answer["Content-Length"] = str(len(data))
    answer["X-Content-Type-Options"] = "nosniff"
    answer["Content-Security-Policy"] = "sandbox; default-src 'none'"
    answer["Content-Disposition"] = f'{"attachment" if download else "inline"}; filename="{name}"'
    return answer


def listing(task: Task, base: str) -> list[dict[str, str]]:
    return [{"name": name, "contentType": content_type(name), "url": f"{base}/{name}"} for name in names(task)]
