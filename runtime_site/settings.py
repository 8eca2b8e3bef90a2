"""One settings module for both profiles.

Nothing set → the embedded default: SQLite (WAL, IMMEDIATE), the kombu filesystem
transport and a local-folder blob store, all under RUNTIME_DATA_DIR (./var).
DATABASE_URL / REDIS_URL / RUNTIME_S3_BUCKET set → PostgreSQL, Redis and S3 (boto3).
"""

from __future__ import annotations

import os
import secrets
from datetime import timedelta
from pathlib import Path
from typing import Any

import dj_database_url
from django.core.exceptions import ImproperlyConfigured
from django.utils.csp import CSP

from runtime_site import config

BASE_DIR = Path(__file__).resolve().parent.parent


def env_bool(name: str, default: bool) -> bool:
    raw = os.getenv(name)
    if raw in (None, ""):
        return default
    if raw not in ("true", "false"):
        raise ImproperlyConfigured(f"{name}={raw!r}: use 'true' or 'false'")
    return raw == "true"


def env_secret(name: str, default: str | None = None) -> str | None:
    """Read NAME, or the file named by NAME_FILE (compose and k8s secrets)."""
    if path := os.getenv(f"{name}_FILE"):
        return Path(path).read_text().strip()
    return os.getenv(name, default)


# --- Django core -------------------------------------------------------------------------
DATA_DIR = Path(os.getenv("RUNTIME_DATA_DIR", BASE_DIR / "var")).resolve()
DEBUG = env_bool("DJANGO_DEBUG", False)
EMBEDDED = not os.getenv("DATABASE_URL")

SECRET_KEY = env_secret("DJANGO_SECRET_KEY")
if not SECRET_KEY:
    if not EMBEDDED:
        raise ImproperlyConfigured("DJANGO_SECRET_KEY (or DJANGO_SECRET_KEY_FILE) is required")
    # The embedded default keeps a generated key in its data folder so sessions survive restarts.
    DATA_DIR.mkdir(parents=True, exist_ok=True)
    key_file = DATA_DIR / "secret_key"
    if not key_file.exists():
        key_file.write_text(secrets.token_urlsafe(50))
    SECRET_KEY = key_file.read_text().strip()

ALLOWED_HOSTS = [h for h in os.getenv("DJANGO_ALLOWED_HOSTS", "localhost,127.0.0.1,[::1],testserver").split(",") if h]

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "drf_spectacular",
    "django_eventstream",
    "tasks_app",
    "checkpoints_app",
    "steering_app",
    "ledger_app",
    "dashboard",
    "mcp_server",
    # sign-in throttling and lockout for the dashboard and admin (runtime_site/security.py)
    "axes",
]

MIDDLEWARE = [
    "runtime_site.middleware.BodySizeLimitMiddleware",
    "runtime_site.middleware.UnsafeTextMiddleware",
    "django.middleware.security.SecurityMiddleware",
    "django.middleware.csp.ContentSecurityPolicyMiddleware",
    # Static files (admin, dashboard) from the web process in every profile: uvicorn serves
    # none, and DEBUG is off everywhere but a developer's laptop (whitenoise.readthedocs.io).
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    # Last, as django-axes asks: answers a locked-out sign-in with its lockout response.
    "axes.middleware.AxesMiddleware",
]

ROOT_URLCONF = "runtime_site.urls"
ASGI_APPLICATION = "runtime_site.asgi.application"
WSGI_APPLICATION = "runtime_site.wsgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]

# --- Browser security (docs/operations.md, Security) -------------------------------------
# Content-Security-Policy on every response (the dashboard and the admin are the pages):
# scripts and styles only from our own static files, no inline script, style attribute or
# event handler (the dashboard's templates have none; its script starts itself), nothing
# framed, forms posted only here. Django's own middleware and settings
# (https://docs.djangoproject.com/en/6.1/ref/csp/).
SECURE_CSP = {
    "default-src": [CSP.SELF],
    "script-src": [CSP.SELF],
    "style-src": [CSP.SELF],
    "img-src": [CSP.SELF, "data:"],
    "connect-src": [CSP.SELF],  # the dashboard's fetches and its SSE stream
    "object-src": [CSP.NONE],
    "base-uri": [CSP.NONE],
    "form-action": [CSP.SELF],
    "frame-ancestors": [CSP.NONE],
}
# Served over HTTPS (RUNTIME_TLS=true): cookies only over TLS, and HSTS (a year unless
# SECURE_HSTS_SECONDS says otherwise). Django sends HSTS only on requests it sees as secure:
# behind a TLS-terminating proxy that sets X-Forwarded-Proto (and strips it from clients),
# also set RUNTIME_TLS_PROXY_HEADER=true.
RUNTIME_TLS = env_bool("RUNTIME_TLS", False)
SESSION_COOKIE_SECURE = CSRF_COOKIE_SECURE = RUNTIME_TLS
SECURE_HSTS_SECONDS = int(os.getenv("SECURE_HSTS_SECONDS", str(365 * 86400 if RUNTIME_TLS else 0)))
SECURE_HSTS_INCLUDE_SUBDOMAINS = env_bool("SECURE_HSTS_INCLUDE_SUBDOMAINS", False)
SECURE_HSTS_PRELOAD = env_bool("SECURE_HSTS_PRELOAD", False)
SECURE_SSL_REDIRECT = env_bool("SECURE_SSL_REDIRECT", False)
if env_bool("RUNTIME_TLS_PROXY_HEADER", False):
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")

USE_TZ = True
TIME_ZONE = "UTC"
STATIC_URL = "static/"
# `manage.py collectstatic` fills it: bin/run does, and so does the image (DJANGO_STATIC_ROOT).
STATIC_ROOT = Path(os.getenv("DJANGO_STATIC_ROOT") or DATA_DIR / "static").resolve()
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    # gzip copies written by collectstatic, served to clients that accept them. Not the
    # manifest variant: that one fails every page that names a file collectstatic has not seen.
    "staticfiles": {"BACKEND": "whitenoise.storage.CompressedStaticFilesStorage"},
}
# The dashboard (dashboard/): people sign in with a Django session.
LOGIN_URL = "/dashboard/login/"

LOGIN_REDIRECT_URL = "/dashboard/"
# A dashboard form from a page older than the session goes to sign-in, not to a bare 403.
CSRF_FAILURE_VIEW = "dashboard.views.csrf_failure"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
# Bodies without a Content-Length are still bounded by Django; BodySizeLimitMiddleware
# answers the usual case with a clear 413.

# --- Database ----------------------------------------------------------------------------
if EMBEDDED:
    DATA_DIR.mkdir(parents=True, exist_ok=True)
    DATABASES: dict[str, Any] = {
        "default": {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": DATA_DIR / "runtime.sqlite3",
            # IMMEDIATE: a transaction that starts reading and then writes cannot fail with
            # "database is locked" without waiting; WAL lets readers run beside the writer.
            "OPTIONS": {
                "transaction_mode": "IMMEDIATE",
                "timeout": 20,
                "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL; PRAGMA busy_timeout=20000;",
            },
        }
    }
else:
    # CONN_MAX_AGE=0 under ASGI: each request gets and returns its own connection.
    DATABASES = {"default": dj_database_url.parse(os.environ["DATABASE_URL"], conn_max_age=0, conn_health_checks=True)}
    from runtime_site import dbpool

    if DATABASES["default"]["ENGINE"] == "django.db.backends.postgresql":
        # Django's, with the connections it makes itself bounded where the process says so:
        # a worker's wait for each answer at most RUNTIME_DB_WORKER_QUERY_SECONDS (runtime_site/dbpool.py).
        DATABASES["default"]["ENGINE"] = "runtime_site.postgresql"
        # A host that drops packets (or a frozen server, whose kernel still accepts) would hold
        # a connection attempt for minutes (psycopg's default: 130 s), not fail it: a worker
        # reconnecting to give a lease back, its heartbeat, the web's pools.
        DATABASES["default"].setdefault("OPTIONS", {}).setdefault("connect_timeout", 5)

    # Prepared statements for what runs through runtime_site.dbpool.bound_cursor (a step's
    # commit) and the lean reads' pool; Django's connections keep none (its default): the
    # ORM's client-side cursors never prepare.
    RUNTIME_DB_PREPARE_THRESHOLD = dbpool.prepare_threshold()
    if test_name := os.getenv("RUNTIME_TEST_DB_NAME"):
        DATABASES["default"]["TEST"] = {"NAME": test_name}  # bin/test: one test database per run
    if env_bool("RUNTIME_DB_POOL", False):
        # Set by runtime_site/asgi.py: the web process borrows connections from a bounded pool,
        # so a burst of requests (hundreds of SSE streams connecting) waits instead of
        # exhausting PostgreSQL's max_connections. Workers keep one connection per process.
        # Across a database restart (runtime_site/dbpool.py): every connection is checked before
        # it is handed out, a failed reconnection is retried for 5 s (then the next request
        # starts afresh, so the pool is back within seconds of the database), and a request
        # waits at most `timeout` for a connection before it is answered 503.
        DATABASES["default"]["CONN_HEALTH_CHECKS"] = False  # the pool's check does it
        DATABASES["default"].setdefault("OPTIONS", {})
        _pool_max = int(os.getenv("RUNTIME_DB_POOL_MAX", "20"))
        DATABASES["default"]["OPTIONS"]["pool"] = {
            # Open from boot (runtime_site.asgi.warm_connections): what one write and the
            # requests beside it use at once, so none waits for a connection to be made.
            # Never above the maximum: psycopg_pool refuses that, and every request with it.
            "min_size": min(int(os.getenv("RUNTIME_DB_POOL_MIN", "2")), _pool_max),
            "max_size": _pool_max,
            "timeout": float(os.getenv("RUNTIME_DB_POOL_TIMEOUT", "5")),
            "reconnect_timeout": 5.0,
            "check": dbpool.check_connection,
            # Each round trip waits at most RUNTIME_DB_QUERY_SECONDS: a frozen server held a
            # request for as long as it was frozen (runtime_site/dbpool.py).
            "connection_class": dbpool.DeadlineConnection,
        }
# The event loop's own pool (runtime_site/dbpool.py: the lean reads of runtime_site/lean.py)
# exists where the sync pool does, on PostgreSQL; elsewhere those reads go the full way.
RUNTIME_DB_ASYNC_POOL = DATABASES["default"]["ENGINE"] == "runtime_site.postgresql" and env_bool(
    "RUNTIME_DB_POOL", False
)

# --- Runtime knobs (config/runtime.yaml, overridable by environment) ---------------------
RUNTIME = config.load()
RUNTIME_DEPLOYMENT = os.getenv("RUNTIME_DEPLOYMENT", "rt")  # namespaces Redis keys and channels
RUNTIME_LEASE_SECONDS = RUNTIME["runtime"]["lease_seconds"]
RUNTIME_HEARTBEAT_SECONDS = RUNTIME["runtime"]["heartbeat_seconds"]
RUNTIME_SLICE_SECONDS = RUNTIME["runtime"]["slice_seconds"]
RUNTIME_SLICE_STEPS = RUNTIME["runtime"]["slice_steps"]
RUNTIME_STEP_SECONDS = RUNTIME["runtime"]["step_seconds"]
RUNTIME_SCAN_SECONDS = RUNTIME["runtime"]["scan_seconds"]
RUNTIME_STALL_SECONDS = RUNTIME["runtime"]["stall_seconds"]
RUNTIME_MAX_BODY_BYTES = RUNTIME["api"]["max_body_bytes"]

# A process stopped inside a transaction (SIGSTOP, a paused VM, a partition) held that
# transaction's locks for as long as it was stopped: a worker's held its task's row, so every
# kill and cancel of the task was a 503 after RUNTIME_DB_QUERY_SECONDS and the reaper's scan
# waited behind it (no task recovered) long after the lease had run out. PostgreSQL ends a
# session idle in a transaction past idle_in_transaction_session_timeout, which releases
# them (the stopped process, running again, finds its session gone: an infrastructure fault).
# None of ours waits on its client that long: a lease, at least 5 s (past a lease the holder's
# heartbeat could not have renewed the row it holds either). RUNTIME_DB_IDLE_IN_TRANSACTION_SECONDS
# ('off': the server's own setting, for a pooler that refuses startup options).
if DATABASES["default"]["ENGINE"] == "runtime_site.postgresql" and (
    _idle_ms := dbpool.idle_in_transaction_ms(RUNTIME_LEASE_SECONDS)
):
    _options = DATABASES["default"].setdefault("OPTIONS", {})
    _options["options"] = f"{_options.get('options', '')} -c idle_in_transaction_session_timeout={_idle_ms}".strip()

# --- Sign-in throttling (django-axes, https://django-axes.readthedocs.io) ------------------
# The dashboard and the admin share Django's sign-in: after limits.login_failures wrong
# passwords a username is locked out for limits.login_lockout_minutes, even with the right
# one (429 with the lockout page). By username, not address: behind a proxy every address is
# the proxy's. An operator lifts a lockout early with `manage.py axes_reset_username NAME`.
AUTHENTICATION_BACKENDS = [
    "runtime_site.security.SignInThrottleBackend",
    "django.contrib.auth.backends.ModelBackend",
]
AXES_FAILURE_LIMIT = RUNTIME["limits"]["login_failures"]
AXES_COOLOFF_TIME = timedelta(minutes=RUNTIME["limits"]["login_lockout_minutes"])
AXES_LOCKOUT_PARAMETERS = ["username"]
AXES_RESET_ON_SUCCESS = True
AXES_HTTP_RESPONSE_CODE = 429
# axes.W006 asks for the address too; by address, one guesser behind the same proxy as
# everyone else would lock everyone out. The username lock is what stops the guessing.
SILENCED_SYSTEM_CHECKS = ["axes.W006"]

DATA_UPLOAD_MAX_MEMORY_SIZE = RUNTIME_MAX_BODY_BYTES
if RUNTIME_HEARTBEAT_SECONDS * 2 > RUNTIME_LEASE_SECONDS:
    raise ImproperlyConfigured("heartbeat_seconds must be at most half of lease_seconds")
if not (isinstance(RUNTIME_STEP_SECONDS, int | float) and 0 <= RUNTIME_STEP_SECONDS < float("inf")):
    # A negative one abandoned every step at its first beat, NaN none ever (0 says "no limit").
    raise ImproperlyConfigured(
        f"step_seconds must be a number of seconds, 0 or more (0: no limit), not {RUNTIME_STEP_SECONDS!r}"
    )

# --- MCP server (/mcp, mcp_server; docs/mcp.md) ---------------------------------------
# Lifetime of a task created over MCP when the client asks for none (ttlMs on the wire).
RUNTIME_MCP_TASK_TTL_SECONDS = int(os.getenv("RUNTIME_MCP_TASK_TTL_SECONDS", str(24 * 3600)))
# Origins allowed besides the local ones (localhost, 127.0.0.1, [::1]): DNS-rebinding guard.
RUNTIME_MCP_ALLOWED_ORIGINS = [o for o in os.getenv("RUNTIME_MCP_ALLOWED_ORIGINS", "").split(",") if o]

# --- Blob store --------------------------------------------------------------------------
RUNTIME_BLOB_DIR = DATA_DIR / "blobs"
RUNTIME_S3 = {
    "bucket": os.getenv("RUNTIME_S3_BUCKET", ""),
    "endpoint_url": os.getenv("RUNTIME_S3_ENDPOINT_URL") or None,
    "region_name": os.getenv("RUNTIME_S3_REGION", "us-east-1"),
    "aws_access_key_id": env_secret("RUNTIME_S3_ACCESS_KEY_ID"),
    "aws_secret_access_key": env_secret("RUNTIME_S3_SECRET_ACCESS_KEY"),
}

# --- Metrics (runtime_site/metrics.py; docs/operations.md "Metrics") ---------------------------
# The bearer token a scraper sends to the web port's /metrics; unset: only this host may scrape.
RUNTIME_METRICS_TOKEN = env_secret("RUNTIME_METRICS_TOKEN") or ""

# --- Audit anchors (tasks_app/audit.py; docs/operations.md "Audit") ---------------------------
# Chain heads are signed with this HMAC secret and anchored in the blob store, both outside the
# database, so that rewriting the audit there (even with recomputed hashes) is detected. Rotation:
# the new secret here, the old ones in RUNTIME_AUDIT_RETIRED_KEYS (comma-separated) so their
# anchors still verify. Unset outside the embedded profile: no anchors, and verify_audit says so.
RUNTIME_AUDIT_KEY = env_secret("RUNTIME_AUDIT_KEY") or ""
RUNTIME_AUDIT_RETIRED_KEYS = [k for k in (env_secret("RUNTIME_AUDIT_RETIRED_KEYS") or "").split(",") if k]
if not RUNTIME_AUDIT_KEY and EMBEDDED:
    # Like the secret key: kept in the data folder, which is not the database.
    DATA_DIR.mkdir(parents=True, exist_ok=True)
    audit_key_file = DATA_DIR / "audit_key"
    if not audit_key_file.exists():
        audit_key_file.write_text(secrets.token_urlsafe(32))
    RUNTIME_AUDIT_KEY = audit_key_file.read_text().strip()

# --- Mail (the email.send tool; Django 6.1 MAILERS) ----------------------------------------
if os.getenv("EMAIL_HOST"):
    MAILERS = {
        "default": {
            "BACKEND": "django.core.mail.backends.smtp.EmailBackend",
            "OPTIONS": {
                "host": os.environ["EMAIL_HOST"],
                "port": int(os.getenv("EMAIL_PORT", "25")),
                "username": os.getenv("EMAIL_HOST_USER", ""),
                "password": env_secret("EMAIL_HOST_PASSWORD", "") or "",
                "use_tls": env_bool("EMAIL_USE_TLS", False),
                "timeout": 10,
            },
        }
    }
else:  # embedded default: mail lands as files in the data folder
    MAILERS = {
        "default": {
            "BACKEND": "django.core.mail.backends.filebased.EmailBackend",
            "OPTIONS": {"file_path": str(DATA_DIR / "mail")},
        }
    }
DEFAULT_FROM_EMAIL = os.getenv("DEFAULT_FROM_EMAIL", "runtime@localhost")

# --- Celery ------------------------------------------------------------------------------
REDIS_URL = os.getenv("REDIS_URL", "")
# How long a doorbell (an event's publish, the web's slice message) waits on Redis: it answers
# in a millisecond, and one that does not must not hold what rings it (a request, a worker).
REDIS_PUBLISH_SECONDS = float(os.getenv("RUNTIME_REDIS_PUBLISH_SECONDS", "1"))
if REDIS_URL:
    CELERY_BROKER_URL = REDIS_URL
    CELERY_BROKER_TRANSPORT_OPTIONS: dict[str, Any] = {
        # Far above the longest slice: recovery is the lease scanner's job, and a short
        # visibility timeout would re-deliver slices that are still running (STACK-NOTES §2).
        "visibility_timeout": 4 * 3600,
        "global_keyprefix": f"{RUNTIME_DEPLOYMENT}:",
        "socket_timeout": 30,
        "socket_connect_timeout": 5,
        "health_check_interval": 25,
        # An idle worker's BRPOP waits this long on the server (kombu's default: 1 s). A worker
        # told to stop reads the reply of the one in flight before it closes the connection (a
        # message popped meanwhile goes back to the queue), so this is time a stop takes.
        "polling_interval": 0.25,
        # Task priority 0 (most urgent) .. 9: on Redis a lower number is served first.
        "priority_steps": [0, 3, 6, 9],
    }
    if env_bool("RUNTIME_DB_POOL", False):
        # The web process (runtime_site/asgi.py): it sends slice messages after a request's
        # commit, while the request still holds its pooled database connection. A frozen Redis
        # (a hung server, a partition that drops packets) held each 30 s a try, four tries:
        # with the pool used up, reads that need no Redis were 503s too. A message that does
        # not go is found again by the stall scan (runtime.stall_seconds): latency, not loss.
        CELERY_BROKER_TRANSPORT_OPTIONS["socket_timeout"] = REDIS_PUBLISH_SECONDS
        CELERY_TASK_PUBLISH_RETRY_POLICY = {"max_retries": 1, "interval_start": 0, "interval_step": 0.2}
else:
    # Embedded default: messages are files, delivered at least once (runtime_site/brokerfs.py).
    _broker = DATA_DIR / "broker"
    for sub in ("queue", "processed", "control"):
        (_broker / sub).mkdir(parents=True, exist_ok=True)
    CELERY_BROKER_URL = "filesystem://"
    CELERY_BROKER_TRANSPORT = "runtime_site.brokerfs:Transport"  # whole messages, at least once (its docstring)
    CELERY_BROKER_TRANSPORT_OPTIONS = {
        "data_folder_in": str(_broker / "queue"),
        "data_folder_out": str(_broker / "queue"),
        "control_folder": str(_broker / "control"),
        "processed_folder": str(_broker / "processed"),
        "polling_interval": 0.05,
    }
CELERY_TASK_SERIALIZER = "json"
CELERY_ACCEPT_CONTENT = ["json"]
CELERY_TASK_IGNORE_RESULT = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_WORKER_HIJACK_ROOT_LOGGER = False
# Celery's Django fixup closes the database connections around every task unless this is
# set, and then only every 2 x this many (celery/fixups/django.py): a worker would connect
# to PostgreSQL afresh for every slice. runtime_site/celery.py drops unusable ones instead.
CELERY_DB_REUSE_MAX = 10_000
CELERY_TASK_DEFAULT_QUEUE = "steps"
CELERY_TASK_ROUTES = {
    "tasks.scan_leases": {"queue": "maintenance"},
    "tasks.trim": {"queue": "maintenance"},
    "tasks.anchor_audit": {"queue": "maintenance"},
}
CELERY_BEAT_SCHEDULE = {
    "scan-leases": {"task": "tasks.scan_leases", "schedule": float(RUNTIME_SCAN_SECONDS)},
    "trim": {"task": "tasks.trim", "schedule": 60.0},
    "anchor-audit": {"task": "tasks.anchor_audit", "schedule": float(RUNTIME["audit"]["anchor_seconds"])},
}
CELERY_BEAT_SCHEDULE_FILENAME = str(DATA_DIR / f"celerybeat-schedule-{RUNTIME_DEPLOYMENT}")

# --- Streaming (django-eventstream; tasks_app/streams/) ---------------------------------
EVENTSTREAM_STORAGE_CLASS = "tasks_app.streams.publish.TaskEventStorage"
EVENTSTREAM_CHANNELMANAGER_CLASS = "tasks_app.streams.publish.TaskChannelManager"
if REDIS_URL:
    # Read at import time by django-eventstream, in every process that publishes (web and workers).
    from redis.backoff import NoBackoff as _NoBackoff
    from redis.connection import parse_url as _parse_redis_url
    from redis.retry import Retry as _Retry

    # socket_timeout and one retry: the publisher's (django-eventstream's redis_client). A frozen
    # Redis held every publish, and the request or slice commit behind it, until it thawed
    # (redis-py's own retries, three with backoff, made it 15 s a publish at a 1 s timeout); one
    # retry still takes a connection a Redis restart ended over to a fresh one. A publish that
    # fails is caught up from storage. The listener (tasks_app/streams/wakeups.py) takes
    # neither: it waits for messages as long as none come.
    EVENTSTREAM_REDIS = {
        **_parse_redis_url(REDIS_URL),
        "socket_connect_timeout": 5,
        "socket_timeout": REDIS_PUBLISH_SECONDS,
        "retry": _Retry(_NoBackoff(), 1),
        "health_check_interval": 25,
    }

# --- DRF ---------------------------------------------------------------------------------
REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": ["tasks_app.auth.ApiKeyAuthentication"],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "DEFAULT_RENDERER_CLASSES": ["rest_framework.renderers.JSONRenderer"],
    "DEFAULT_PARSER_CLASSES": ["runtime_site.parsers.SafeJSONParser"],
    "DEFAULT_CONTENT_NEGOTIATION_CLASS": "runtime_site.parsers.NamedFormatNegotiation",
    "EXCEPTION_HANDLER": "runtime_site.errors.exception_handler",
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "UNAUTHENTICATED_USER": None,
}
SPECTACULAR_SETTINGS = {
    "TITLE": "Long-task agent runtime",
    "VERSION": "0.1.0",
    "SERVE_INCLUDE_SCHEMA": False,
    "DESCRIPTION": "Start, watch, steer and audit long-running agent tasks. Every error is "
    '{"error": {"code", "message", ...}}. The contract: runtime_site/openapi.py.',
    "POSTPROCESSING_HOOKS": ["drf_spectacular.hooks.postprocess_schema_enums", "runtime_site.openapi.postprocess"],
    "COMPONENT_SPLIT_REQUEST": True,
}

# RUNTIME_LOG_FORMAT=json: one JSON object per line with task, tenant, trace and worker
# (runtime_site/logs.py); "plain" (the default) is for people reading a terminal.
RUNTIME_LOG_FORMAT = os.getenv("RUNTIME_LOG_FORMAT", "plain")
if RUNTIME_LOG_FORMAT not in ("plain", "json"):
    raise ImproperlyConfigured(f"RUNTIME_LOG_FORMAT={RUNTIME_LOG_FORMAT!r}: use 'plain' or 'json'")
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {
        "plain": {"format": "%(asctime)s %(levelname)s %(name)s %(message)s"},
        "json": {"()": "runtime_site.logs.JsonFormatter"},
    },
    "filters": {"redact": {"()": "tasks_app.redaction.RedactingFilter"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": RUNTIME_LOG_FORMAT, "filters": ["redact"]}},
    "root": {"handlers": ["console"], "level": os.getenv("RUNTIME_LOG_LEVEL", "INFO")},
    # uvicorn set up its own handlers before Django loaded, and they know nothing of the
    # redaction filter: its lines (an access line quotes the query string) go through ours.
    "loggers": {
        name: {"handlers": ["console"], "propagate": False} for name in ("uvicorn", "uvicorn.error", "uvicorn.access")
    },
}
