# Every process that enqueues (web, worker, beat, management commands) must bind
# shared_task to this app, or .delay() silently talks to amqp:// (STACK-NOTES §3.2).
from runtime_site.celery import app as celery_app

__all__ = ("celery_app",)
