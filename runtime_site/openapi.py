"""The REST API's contract as served at /runtime/schema (drf-spectacular).

The views build their answers as plain dicts (tasks_app.selectors, command_body), so what
they answer is declared here, next to the one error shape, the bearer scheme and the SSE
endpoint that DRF cannot see. Attached to the views by drf-spectacular extensions, so the
views stay thin; tests/test_api_contract.py holds the served schema against the running
server with schemathesis. A field added to an answer belongs here too (the test fails
on an undeclared status or a wrong type, not on a missing optional field).
"""

from __future__ import annotations

from typing import Any

from drf_spectacular.extensions import OpenApiAuthenticationExtension, OpenApiViewExtension
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import (
    OpenApiExample,
    OpenApiParameter,
    OpenApiResponse,
    extend_schema,
    extend_schema_view,
    inline_serializer,
)
from drf_spectacular.views import SpectacularAPIView
from rest_framework import serializers
from rest_framework.renderers import JSONRenderer
from rest_framework.request import Request
from rest_framework.response import Response

from common import json_safety
from tasks_app.models import Role, Scope
from tasks_app.states import Status


class BearerApiKey(OpenApiAuthenticationExtension):
    target_class = "tasks_app.auth.ApiKeyAuthentication"
    name = "bearerAuth"

    def get_security_definition(self, auto_schema: Any) -> dict[str, Any]:
        return {
            "type": "http",
            "scheme": "bearer",
            "bearerFormat": "rt_<prefix>_<secret> or JWT",
            "description": "An API key, bound to one tenant and role: `Authorization: Bearer rt_...`; or, "
            "with `oauth` configured, an access token (JWT) of the configured issuer for this server "
            "(its audience), naming the user and the tenant, its scopes mapped to a role "
            "(`/.well-known/oauth-protected-resource`).",
        }


# --- The one error shape (runtime_site/errors.py) ----------------------------------------------


class ErrorDetail(serializers.Serializer):
    def get_fields(self) -> dict[str, serializers.Field]:
        # Built here: a declared attribute named "fields" would hide Serializer.fields.
        return {
            "code": serializers.CharField(help_text="machine-readable: invalid_request, not_found, ..."),
            "message": serializers.CharField(),
            "fields": serializers.JSONField(required=False, help_text="invalid_request: each field's problem"),
            "currentVersion": serializers.IntegerField(required=False, help_text="version_conflict"),
            "snapshot": serializers.JSONField(
                required=False, help_text="version_conflict, command_refused: the task as it is now"
            ),
            "status": serializers.CharField(required=False, help_text="not_finished: the MCP status"),
            "runtimeStatus": serializers.CharField(required=False, help_text="not_finished"),
        }


class Error(serializers.Serializer):
    error = ErrorDetail()


def _error(description: str) -> OpenApiResponse:
    return OpenApiResponse(Error, description=description)


# Every operation may answer these: a bad parameter or body, no or a bad key, a role too low,
# the key's or tenant's request rate reached (runtime_site/ratelimit.py, config/runtime.yaml
# `limits`), and the database briefly unavailable. 429 and 503 carry Retry-After (see postprocess).
RATE_LIMITED = "the key's or the tenant's request rate limit is reached (throttled); retry after Retry-After"
COMMON = {
    400: _error("invalid request (the error names the field)"),
    401: _error("no or an invalid API key or access token (WWW-Authenticate says which, see postprocess)"),
    403: _error("the key's role does not allow this, or the access token grants nothing here"),
    429: _error(RATE_LIMITED),
    503: _error("the database, or the issuer of an access token, is unavailable; retry"),
}
ON_TASK = {**COMMON, 404: _error("no such task in the key's tenant")}
ON_KEY = {**COMMON, 404: _error("no such key among those this key may manage")}


# --- Answers -------------------------------------------------------------------------------------


class InputRequestOut(serializers.Serializer):
    key = serializers.CharField()
    prompt = serializers.CharField()
    schema = serializers.JSONField(help_text="JSON Schema the answer must match")


class TaskUrls(serializers.Serializer):
    statusUrl = serializers.CharField()  # noqa: N815
    streamUrl = serializers.CharField(help_text="Server-Sent Events, see GET /runtime/tasks/{task_id}/events")  # noqa: N815
    resultUrl = serializers.CharField()  # noqa: N815


class TaskSnapshot(TaskUrls):
    """tasks_app.selectors.task_snapshot: the same snapshot REST, MCP and the stream give."""

    taskId = serializers.UUIDField()  # noqa: N815
    agent = serializers.CharField()
    status = serializers.ChoiceField(
        choices=["queued", "working", "input_required", "completed", "failed", "cancelled"],
        help_text="the MCP Tasks status",
    )
    runtimeStatus = serializers.ChoiceField(choices=Status.choices)  # noqa: N815
    statusMessage = serializers.CharField(allow_blank=True)  # noqa: N815
    progress = serializers.FloatField()
    phase = serializers.CharField(allow_blank=True)
    stateVersion = serializers.IntegerField(help_text="send it as expectedVersion when steering")  # noqa: N815
    planVersion = serializers.IntegerField()  # noqa: N815
    stepsDone = serializers.IntegerField()  # noqa: N815
    cost = serializers.FloatField()
    lastCheckpoint = serializers.IntegerField(allow_null=True)  # noqa: N815
    recoveries = serializers.IntegerField(help_text="workers lost since creation or the last redrive")
    recoveriesInARow = serializers.IntegerField(  # noqa: N815
        help_text="recoveries in a row without a step beyond the furthest committed; above runtime.max_recoveries "
        "the task is dead-lettered"
    )
    infrastructureFaults = serializers.IntegerField()  # noqa: N815
    priority = serializers.IntegerField()
    cancelRequested = serializers.BooleanField()  # noqa: N815
    error = serializers.JSONField(allow_null=True)
    goal = serializers.CharField(allow_blank=True)
    constraints = serializers.JSONField()
    inputRequests = InputRequestOut(many=True)  # noqa: N815
    createdAt = serializers.DateTimeField(allow_null=True)  # noqa: N815
    updatedAt = serializers.DateTimeField(allow_null=True)  # noqa: N815
    expiresAt = serializers.DateTimeField(allow_null=True)  # noqa: N815


class TaskCreated(TaskUrls):
    taskId = serializers.UUIDField()  # noqa: N815
    status = serializers.CharField()
    runtimeStatus = serializers.ChoiceField(choices=Status.choices)  # noqa: N815


class TaskPage(serializers.Serializer):
    next = serializers.URLField(allow_null=True, help_text="the next page, or null")
    previous = serializers.URLField(allow_null=True)
    results = TaskSnapshot(many=True)


class CheckpointOut(serializers.Serializer):
    sequence = serializers.IntegerField()
    stepName = serializers.CharField()  # noqa: N815
    nextStep = serializers.CharField(allow_blank=True)  # noqa: N815
    schemaVersion = serializers.IntegerField()  # noqa: N815
    planVersion = serializers.IntegerField()  # noqa: N815
    reason = serializers.CharField()
    checksum = serializers.CharField()
    valid = serializers.BooleanField()
    discarded = serializers.BooleanField()
    artifactRefs = serializers.JSONField()  # noqa: N815
    createdAt = serializers.DateTimeField()  # noqa: N815


class TaskResult(serializers.Serializer):
    taskId = serializers.UUIDField()  # noqa: N815
    status = serializers.CharField()
    runtimeStatus = serializers.ChoiceField(choices=Status.choices)  # noqa: N815
    result = serializers.JSONField(allow_null=True)
    error = serializers.JSONField(allow_null=True)


class AuditRecordOut(serializers.Serializer):
    seq = serializers.IntegerField()
    actor = serializers.CharField()
    action = serializers.CharField()
    fromStatus = serializers.CharField(allow_blank=True)  # noqa: N815
    toStatus = serializers.CharField(allow_blank=True)  # noqa: N815
    beforeVersion = serializers.IntegerField()  # noqa: N815
    afterVersion = serializers.IntegerField()  # noqa: N815
    reason = serializers.CharField(allow_blank=True)
    createdAt = serializers.DateTimeField()  # noqa: N815
    hash = serializers.CharField()


class SteeringCommandOut(serializers.Serializer):
    """steering_app.api.views.command_body."""

    commandId = serializers.CharField()  # noqa: N815
    type = serializers.CharField()
    payload = serializers.JSONField()
    status = serializers.CharField()
    version = serializers.IntegerField()
    expectedVersion = serializers.IntegerField()  # noqa: N815
    requestedBy = serializers.CharField()  # noqa: N815
    reason = serializers.CharField(allow_blank=True)
    outcome = serializers.CharField(allow_blank=True)
    createdAt = serializers.DateTimeField()  # noqa: N815
    appliedAt = serializers.DateTimeField(allow_null=True)  # noqa: N815
    killPolicy = inline_serializer(  # noqa: N815
        "KillPolicy",
        {
            "cut": serializers.ListField(child=serializers.CharField(), help_text="tools cut mid-call"),
            "finishFirst": serializers.ListField(
                child=serializers.CharField(), help_text="tools whose call in flight returns first"
            ),
            "default": serializers.CharField(help_text="cut or finish_first: what any other tool gets"),
            "graceSeconds": serializers.FloatField(),
        },
        required=False,
        help_text="kill only: what the kill does to a tool call in flight (config/runtime.yaml kill)",
    )


class KeyOut(serializers.Serializer):
    """tasks_app.api.keys.key_body."""

    id = serializers.CharField(help_text="the key's public prefix (rt_<id>_...)")
    name = serializers.CharField()
    role = serializers.ChoiceField(choices=Role.choices)
    scopes = serializers.ListField(
        child=serializers.ChoiceField(choices=Scope.choices), allow_null=True, help_text="null: all its role allows"
    )
    userId = serializers.IntegerField()  # noqa: N815
    createdAt = serializers.DateTimeField()  # noqa: N815
    expiresAt = serializers.DateTimeField(allow_null=True)  # noqa: N815
    lastUsedAt = serializers.DateTimeField(allow_null=True)  # noqa: N815
    revokedAt = serializers.DateTimeField(allow_null=True)  # noqa: N815
    rotatedFrom = serializers.CharField(allow_null=True, help_text="the id of the key it replaced")  # noqa: N815


class KeyIssued(KeyOut):
    token = serializers.CharField(help_text="the whole key, shown this once (only its hash is stored)")


class KeyRotated(KeyIssued):
    previous = KeyOut(help_text="the replaced key, expiring after security.key_rotation_grace_seconds")


def _list_of(name: str, item: type[serializers.Serializer], **extra: serializers.Field) -> serializers.Serializer:
    return inline_serializer(name, {**extra, "results": item(many=True)})


_status = "(" + "|".join(Status.values) + ")"
STATUS_LIST = f"^({_status}(,{_status})*)?$"
TASK_ID = OpenApiParameter("task_id", OpenApiTypes.UUID, OpenApiParameter.PATH)


# --- The operations ------------------------------------------------------------------------------

VIEW_INPUT = "the view's InputSerializer"  # as `request`: the view's own, so the two never drift


def _view(target: str, request_name: str = "", **methods: dict[str, Any]) -> type[OpenApiViewExtension]:
    """A view extension declaring `methods` (extend_schema's arguments per method) on `target`."""

    def view_replacement(self: OpenApiViewExtension) -> type:
        view: Any = self.target_class  # the class itself by now (target_class names it by dotted path)
        # Named for what it is: every view's is called InputSerializer.
        renamed = type(request_name, (view.InputSerializer,), {}) if request_name else None
        return extend_schema_view(
            **{
                method: extend_schema(
                    **{**kwargs, "request": renamed} if kwargs.get("request") == VIEW_INPUT else kwargs
                )
                for method, kwargs in methods.items()
            }
        )(view)

    return type(
        target.rsplit(".", 1)[1] + "Schema",
        (OpenApiViewExtension,),
        {"target_class": target, "view_replacement": view_replacement},
    )


TaskListCreateSchema = _view(
    "tasks_app.api.views.TaskListCreateApi",
    "CreateTask",
    get={
        "operation_id": "listTasks",
        "summary": "The key's tenant's tasks, newest first",
        "parameters": [
            # A pattern, not an array of enums: the empty value is valid too (no filter).
            OpenApiParameter(
                "status",
                {"type": "string", "pattern": STATUS_LIST},
                description="only these runtime statuses, comma-separated: " + ", ".join(Status.values),
            ),
            # Up to 18 digits are read; more than 200 are capped at 200.
            OpenApiParameter(
                "limit",
                {"type": "integer", "minimum": 1, "maximum": 10**18 - 1},
                description="page size (default 50, at most 200)",
            ),
            OpenApiParameter("cursor", str, description="from a page's next or previous link; anything else is a 400"),
        ],
        "responses": {200: TaskPage, **COMMON},
    },
    post={
        "operation_id": "createTask",
        "summary": "Start a task",
        "request": VIEW_INPUT,
        "examples": [
            OpenApiExample("noop", {"agent": "noop", "input": {"steps": 3}, "goal": "try it"}, request_only=True)
        ],
        "parameters": [
            OpenApiParameter(
                "Idempotency-Key",
                str,
                OpenApiParameter.HEADER,
                pattern=r"^[A-Za-z0-9._:\-]{1,200}$",
                description="the same key and body again: the same task (200)",
            )
        ],
        "responses": {
            201: TaskCreated,
            200: OpenApiResponse(TaskCreated, description="replayed by Idempotency-Key"),
            422: _error(
                "unknown agent, input not matching the agent's schema, or an Idempotency-Key reused with another body"
            ),
            **COMMON,
            429: _error(
                RATE_LIMITED + "; or the tenant's queued tasks are at "
                "limits.queued_tasks_per_tenant (quota_exceeded, no Retry-After)"
            ),
        },
    },
)
TaskDetailSchema = _view(
    "tasks_app.api.views.TaskDetailApi",
    get={
        "operation_id": "getTask",
        "summary": "A task's snapshot",
        "parameters": [TASK_ID],
        "responses": {200: TaskSnapshot, **ON_TASK},
    },
)
TaskCancelSchema = _view(
    "tasks_app.api.views.TaskCancelApi",
    "CancelTask",
    post={
        "operation_id": "cancelTask",
        "summary": "Cancel a task (at its next safe point)",
        "parameters": [TASK_ID],
        "request": VIEW_INPUT,
        "responses": {202: TaskSnapshot, 409: _error("already finished"), **ON_TASK},
    },
)
TaskCheckpointsSchema = _view(
    "tasks_app.api.views.TaskCheckpointsApi",
    get={
        "operation_id": "listCheckpoints",
        "summary": "A task's checkpoints",
        "parameters": [TASK_ID],
        "responses": {200: _list_of("CheckpointList", CheckpointOut), **ON_TASK},
    },
)
TaskResultSchema = _view(
    "tasks_app.api.views.TaskResultApi",
    get={
        "operation_id": "getTaskResult",
        "summary": "A finished task's result or error",
        "parameters": [TASK_ID],
        "responses": {200: TaskResult, 409: _error("not finished yet (not_finished)"), **ON_TASK},
    },
)


class ArtifactOut(serializers.Serializer):
    """tasks_app.artifacts.listing."""

    name = serializers.CharField()
    contentType = serializers.CharField()  # noqa: N815
    url = serializers.CharField(help_text="where GET serves it (this API)")


TaskArtifactsSchema = _view(
    "tasks_app.api.artifacts.TaskArtifactsApi",
    get={
        "operation_id": "listTaskArtifacts",
        "summary": "What a task wrote for people to read (its reports, files)",
        "parameters": [TASK_ID],
        "responses": {200: _list_of("ArtifactList", ArtifactOut, taskId=serializers.UUIDField()), **ON_TASK},
    },
)
TaskArtifactSchema = _view(
    "tasks_app.api.artifacts.TaskArtifactApi",
    get={
        "operation_id": "getTaskArtifact",
        "summary": "One artifact, as stored (its content type by its name)",
        "parameters": [
            TASK_ID,
            OpenApiParameter("name", OpenApiTypes.STR, OpenApiParameter.PATH),
            OpenApiParameter(
                "download", OpenApiTypes.STR, OpenApiParameter.QUERY, description="1 or true: as an attachment"
            ),
        ],
        "responses": {
            (200, "*/*"): OpenApiResponse(OpenApiTypes.BINARY, description="the artifact's bytes"),
            **ON_TASK,
            404: _error("no such task in the key's tenant, or no such artifact"),
            413: _error("larger than api.max_artifact_bytes (too_large)"),
        },
    },
)
TaskAuditSchema = _view(
    "tasks_app.api.views.TaskAuditApi",
    get={
        "operation_id": "getTaskAudit",
        "summary": "A task's hash-chained audit records",
        "parameters": [TASK_ID],
        "responses": {
            200: _list_of(
                "AuditList",
                AuditRecordOut,
                head=serializers.CharField(allow_blank=True, help_text="hash of the newest record"),
            ),
            **ON_TASK,
        },
    },
)
TaskSteeringSchema = _view(
    "steering_app.api.views.TaskSteeringApi",
    "SteerTask",
    get={
        "operation_id": "listSteeringCommands",
        "summary": "A task's steering commands, in order",
        "parameters": [TASK_ID],
        "responses": {200: _list_of("SteeringCommandList", SteeringCommandOut), **ON_TASK},
    },
    post={
        "operation_id": "steerTask",
        "summary": "Pause, resume, adjust, re-plan, answer (applied at a safe point) or kill (at once)",
        "description": "`kill` is the emergency stop: it aborts the running step without waiting for a safe "
        "point, needs a `reason` (else 422 invalid_payload), and its answer carries the "
        "`killPolicy`, what it does to a tool call in flight.",
        "parameters": [TASK_ID],
        "request": VIEW_INPUT,
        "responses": {
            202: SteeringCommandOut,
            409: _error(
                "version_conflict or command_refused (finished, held): both with the task as it is now (snapshot)"
            ),
            422: _error("a payload this command cannot take, or a kill without a reason (invalid_payload)"),
            **ON_TASK,
        },
    },
)
TaskInputSchema = _view(
    "steering_app.api.views.TaskInputApi",
    "Answer",
    post={
        "operation_id": "answerInput",
        "summary": "Answer an open input request (an approval: approve or reject)",
        "parameters": [
            TASK_ID,
            OpenApiParameter(
                "key", str, OpenApiParameter.PATH, description="the input request's key (inputRequests[].key)"
            ),
        ],
        "request": VIEW_INPUT,
        "responses": {
            202: SteeringCommandOut,
            409: _error("no such open request, or already answered"),
            422: _error("an answer not matching the request's schema"),
            **ON_TASK,
        },
    },
)


# --- API keys (tasks_app/api/keys.py) ------------------------------------------------------------

KEY_ID = OpenApiParameter("key_id", str, OpenApiParameter.PATH, description="a key's id (its prefix)")
KeyListCreateSchema = _view(
    "tasks_app.api.keys.KeyListCreateApi",
    "CreateKey",
    get={
        "operation_id": "listKeys",
        "summary": "The keys this key may manage (a tenant admin's: all of the tenant's)",
        "responses": {200: inline_serializer("KeyList", {"keys": KeyOut(many=True)}), **COMMON},
    },
    post={
        "operation_id": "createKey",
        "summary": "Make a key, at most as wide as this one and expiring no later (by default, with it)",
        "request": VIEW_INPUT,
        "responses": {201: KeyIssued, **COMMON},
    },
)
KeyDetailSchema = _view(
    "tasks_app.api.keys.KeyDetailApi",
    get={"operation_id": "getKey", "summary": "A key", "parameters": [KEY_ID], "responses": {200: KeyOut, **ON_KEY}},
    delete={
        "operation_id": "revokeKey",
        "summary": "Revoke a key: it stops working on its next request",
        "parameters": [KEY_ID],
        "responses": {200: KeyOut, **ON_KEY},
    },
)
KeyRotateSchema = _view(
    "tasks_app.api.keys.KeyRotateApi",
    post={
        "operation_id": "rotateKey",
        "summary": "A new key with the same grant; the old one keeps working for security.key_rotation_grace_seconds",
        "parameters": [KEY_ID],
        "request": None,
        "responses": {
            201: KeyRotated,
            **ON_KEY,
            400: _error("a revoked key cannot be rotated"),
            403: _error(
                "another user's key (only its own user rotates it; an admin may revoke it), "
                "or one wider or longer-lived than this one"
            ),
        },
    },
)


# --- The SSE endpoint (a plain Django view: DRF and so drf-spectacular cannot see it) ------------

SSE_OPERATION = {
    "get": {
        "operationId": "streamTaskEvents",
        "summary": "A task's events as Server-Sent Events (docs/streaming.md)",
        "description": "`task.snapshot` first (its id is `<channel>:<seq>`), then every event after it: "
        "progress, status changes, input requests, logs, and a terminal event. Reconnect "
        "with `Last-Event-ID` to resume; past the replay window the stream starts with "
        "a fresh snapshot. A browser with a dashboard session may use its cookie instead "
        "of a key.",
        "tags": ["runtime"],
        "security": [{"bearerAuth": []}],
        "parameters": [
            {"name": "task_id", "in": "path", "required": True, "schema": {"type": "string", "format": "uuid"}},
            {
                "name": "Last-Event-ID",
                "in": "header",
                "required": False,
                "schema": {"type": "string"},
                "description": "the id of the last event received",
            },
        ],
        "responses": {
            "200": {
                "description": "the event stream",
                "content": {
                    "text/event-stream": {
                        "schema": {
                            "type": "string",
                            "description": "`id:`, `event:` and `data:` lines; data is a JSON object",
                        }
                    }
                },
            },
            **{
                str(code): {
                    "description": description,
                    "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
                }
                for code, description in (
                    (400, "a malformed Last-Event-ID"),
                    (401, "no or an invalid API key or access token"),
                    (403, "a key without the read scope, or an access token that grants nothing here"),
                    (404, "no such task in the key's tenant"),
                    (429, RATE_LIMITED),
                    (503, "the database, or the issuer of an access token, is unavailable; retry"),
                )
            },
        },
    },
}


# --- MCP authorization: the protected resource metadata (RFC 9728, a plain Django view) ----------

METADATA_PATH = "/.well-known/oauth-protected-resource"
METADATA_OPERATION = {
    "get": {
        "operationId": "getProtectedResourceMetadata",
        "summary": "Which authorization server issues tokens for this server (RFC 9728)",
        "description": "Public. `/mcp` answers a request without valid credentials with 401 and "
        '`WWW-Authenticate: Bearer resource_metadata="<this URL>"`. The same document is served at '
        "`/.well-known/oauth-protected-resource/mcp`. `authorization_servers` is present once `oauth` "
        "is configured (config/runtime.yaml).",
        "tags": ["auth"],
        "security": [],
        "responses": {
            "200": {
                "description": "the metadata",
                "content": {
                    "application/json": {
                        "schema": {
                            "type": "object",
                            "required": ["resource", "bearer_methods_supported", "scopes_supported"],
                            "properties": {
                                "resource": {"type": "string", "description": "this server's resource identifier"},
                                "authorization_servers": {"type": "array", "items": {"type": "string"}},
                                "bearer_methods_supported": {"type": "array", "items": {"type": "string"}},
                                "scopes_supported": {"type": "array", "items": {"type": "string"}},
                                "resource_name": {"type": "string"},
                            },
                        }
                    }
                },
            }
        },
    }
}


# --- Free-form JSON in requests ------------------------------------------------------------------

# What common.json_safety lets through to the database: an agent's input, a policy, a payload,
# an answer, and fields a body carries beyond the documented ones (ignored) may be any JSON but
# this (a 400 naming the place otherwise).
_ref = {"JsonValue": {"$ref": "#/components/schemas/JsonValue"}, "JsonItem": {"$ref": "#/components/schemas/JsonItem"}}
JSON_VALUE = {
    "description": "any JSON but null that the database can store: no NUL character, numbers within "
    f"64-bit integers, nested at most {json_safety.MAX_DEPTH} levels deep",
    "anyOf": [
        {"type": "string"},
        {"type": "boolean"},
        {"type": "integer", "minimum": json_safety.MIN_INT, "maximum": json_safety.MAX_INT},
        {"type": "number", "minimum": json_safety.MIN_INT, "maximum": json_safety.MAX_INT},
        {"type": "array", "items": _ref["JsonItem"]},
        {"type": "object", "additionalProperties": _ref["JsonItem"]},
    ],
}
JSON_ITEM = {
    "description": "a JsonValue, or null",
    "anyOf": [_ref["JsonValue"], {"type": "string", "nullable": True, "enum": [None]}],
}


# DRF trims a string field before it checks it is not blank: at least one character Python's
# str.strip() keeps (ECMA's \s, and the separators \x1c-\x1f and \x85 it lacks).
NOT_BLANK = r"[^\s\x1c-\x1f\x85]"


def _free_form_to_json_value(schema: dict[str, Any]) -> None:
    schema.setdefault("additionalProperties", _ref["JsonItem"])
    for name, prop in schema.get("properties", {}).items():
        if prop.get("type") == "string" and prop.get("minLength") and not {"pattern", "enum"} & prop.keys():
            prop["pattern"] = NOT_BLANK
        if prop.get("type") in ("integer", "number"):  # json_safety: 64 bits, whatever the field
            prop.setdefault("minimum", json_safety.MIN_INT)
            prop.setdefault("maximum", json_safety.MAX_INT)
        if not {"type", "$ref", "allOf", "oneOf", "anyOf"} & prop.keys():  # a JSONField: any value
            schema["properties"][name] = {**prop, "allOf": [_ref["JsonValue"]]}
        elif prop.get("type") == "object" and prop.get("additionalProperties") == {}:  # a DictField
            prop["additionalProperties"] = _ref["JsonItem"]


# --- Hooks (SPECTACULAR_SETTINGS["POSTPROCESSING_HOOKS"]) ----------------------------------------

WWW_AUTHENTICATE = {
    "required": True,
    "schema": {"type": "string", "pattern": "^Bearer "},
    "description": 'RFC 6750 §3: `Bearer realm="runtime", resource_metadata="<RFC 9728 metadata URL>"`; '
    'with a credential that was refused also `error="invalid_token"` (unknown, malformed, revoked or '
    "expired; `invalid_request` for an Authorization header that is not `Bearer <credential>`) and an "
    "`error_description`. No error code when no credential came.",
}


def postprocess(result: dict[str, Any], generator: Any, request: Any, public: bool) -> dict[str, Any]:
    """The stream beside the other operations; request bodies as what is accepted (free-form JSON
    that json_safety lets through, numbers within 64 bits, strings not blank once trimmed)."""
    result["paths"]["/runtime/tasks/{task_id}/events"] = SSE_OPERATION
    result["paths"][METADATA_PATH] = METADATA_OPERATION
    for item in result["paths"].values():
        for operation in item.values():
            if "401" in operation.get("responses", {}):  # tasks_app.auth.challenge, on every edge
                operation["responses"]["401"]["headers"] = {"WWW-Authenticate": WWW_AUTHENTICATE}
            if "429" in operation.get("responses", {}):
                # DRF's Throttled (and the SSE view) set it; a quota_exceeded create does not.
                operation["responses"]["429"]["headers"] = {
                    "Retry-After": {
                        "required": operation["operationId"] != "createTask",
                        "schema": {"type": "integer", "minimum": 1},
                        "description": "seconds until the rate limit's window ends",
                    }
                }
    schemas = result["components"]["schemas"]
    for name, schema in schemas.items():
        if name.endswith("Request"):  # COMPONENT_SPLIT_REQUEST: the request side of each body
            _free_form_to_json_value(schema)
    schemas["JsonValue"], schemas["JsonItem"] = JSON_VALUE, JSON_ITEM
    schemas["CreateKeyRequest"]["properties"]["scopes"]["minItems"] = (
        1  # allow_empty=False, which drf-spectacular drops
    )
    return result


class SchemaApi(SpectacularAPIView):
    """GET /runtime/schema (YAML, or JSON with ?format=json or Accept). Its refusals are the
    API's one JSON error shape: DRF renders an error with the renderer it negotiated, and
    here that was the YAML one (a 405 or 406 came back as an OpenAPI document's media type)."""

    def finalize_response(self, request: Request, response: Response, *args: Any, **kwargs: Any) -> Response:
        if response.status_code >= 400:
            request.accepted_renderer, request.accepted_media_type = JSONRenderer(), "application/json"
        return super().finalize_response(request, response, *args, **kwargs)
