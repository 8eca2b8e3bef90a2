"""Our patch to Celery's worker consumer: a message it cannot run is set aside, not lost
and not fatal (install() says what and why).

Written against celery 5.7.0: it wraps library internals (Consumer.create_task_handler and
the handlers it calls for bad messages), so another release must be read against it
before it is let in.
"""

from __future__ import annotations

from importlib.metadata import version
from typing import Any

from celery.worker.consumer import consumer as _celery_consumer
from kombu.serialization import loads, prepare_accept_content
from kombu.utils.json import dumps

from runtime_site.patches.kombu import delivering_from, set_aside

celery_consumer: Any = _celery_consumer  # internals the type stubs do not show

WRITTEN_FOR = "5.7.0"
if version("celery") != WRITTEN_FOR:
    raise RuntimeError(
        f"runtime_site/patches/consumer.py wraps celery {WRITTEN_FOR} internals, but {version('celery')} is "
        "installed: check the patch against its source, then update WRITTEN_FOR"
    )


def install() -> None:
    """What kombu delivers whole but Celery cannot run (runtime_site/patches/kombu.py sets
    aside what kombu cannot deliver at all):

    - a body in a content type the worker does not accept, or that does not decode. Under
      task protocol 2 the body is decoded in the pool process, so such a message reached the
      pool and ended there as a failed task run, acknowledged: gone, its reason one log line
      among the task errors;
    - headers that are no object, a task name that is no text (an unhashable one raised a
      TypeError out of the consumer: the worker died), an unregistered task name, or a
      message without a task header: rejected without requeue, gone;
    - anything else the consumer's handler raises for a message: the worker died, and the
      message, left in Redis's unacked set, came back at the visibility timeout to kill the
      next worker.

    Each is now set aside (the deployment's unreadable list on Redis) with the reason,
    logged once, and acknowledged, so it neither returns nor holds the prefetch slot, and
    the worker takes the next message. A broker connection error still goes up: the
    consumer reconnects and the message, unacknowledged, is delivered again."""
    consumer_class = celery_consumer.Consumer
    create_task_handler = consumer_class.create_task_handler

    def create_task_handler_setting_aside(self: Any, *args: Any, **kwargs: Any) -> Any:
        on_task_received = create_task_handler(self, *args, **kwargs)
        accept = prepare_accept_content(self.app.conf.accept_content)

        def on_task_received_or_set_aside(message: Any) -> Any:
            if (reason := unrunnable(message, self.strategies, accept)) is not None:
                return _set_aside_and_ack(self, message, reason)
            try:
                return on_task_received(message)
            except KeyError as exc:
                # kombu's Redis transport counts KeyError among its connection errors, but
                # here it is about the message (a header it lacks): raised, it made the
                # consumer reconnect and put back every unacknowledged message, this one too,
                # to come round and do it again.
                return _set_aside_and_ack(self, message, f"the consumer failed on it: KeyError: {exc}")
            except self.connection_errors:
                raise
            except Exception as exc:  # noqa: BLE001 (the worker died of it; the lease scanner re-finds the work)
                return _set_aside_and_ack(self, message, f"the consumer failed on it: {type(exc).__name__}: {exc}")

        return on_task_received_or_set_aside

    # Reached from inside Celery's handler (what the strategy raises), after Celery logged
    # the message itself: it is kept before Celery acknowledges or rejects it.
    on_invalid_task, on_decode_error = consumer_class.on_invalid_task, consumer_class.on_decode_error

    def keep_then_invalid_task(self: Any, body: Any, message: Any, exc: Exception) -> Any:
        _keep(message, f"{type(exc).__name__}: {exc}")
        return on_invalid_task(self, body, message, exc)

    def keep_then_decode_error(self: Any, message: Any, exc: Exception) -> Any:
        _keep(message, f"{type(exc).__name__}: {exc}")
        return on_decode_error(self, message, exc)

    consumer_class.create_task_handler = create_task_handler_setting_aside
    consumer_class.on_invalid_task = keep_then_invalid_task
    consumer_class.on_decode_error = keep_then_decode_error


def unrunnable(message: Any, strategies: Any, accept: Any) -> str | None:
    """Why Celery cannot run this message (task protocol 2, the one we send), or None.

    The body is decoded here, in the worker's main process, as the pool process would:
    our bodies are a task id and a few numbers, and a body that will not decode must be
    caught before it reaches the pool."""
    headers = message.headers
    if not isinstance(headers, dict):
        return "headers that are no object"
    name = headers.get("task")
    if not isinstance(name, str):
        return "no task name"
    if name not in strategies:
        return f"no task {name[:200]!r} in this worker"
    if not isinstance(headers.get("id"), str):
        return "no task id"
    if (wrong := _wrong_header(headers)) is not None:
        return wrong
    try:
        body = loads(message.body, message.content_type, message.content_encoding, accept=accept)
    except Exception as exc:  # noqa: BLE001 (ContentDisallowed, DecodeError: whatever it raises is about the body)
        return f"a body that does not decode: {type(exc).__name__}: {exc}"
    if not (
        isinstance(body, list | tuple)
        and len(body) == 3
        and isinstance(body[0], list | tuple)
        and isinstance(body[1], dict)
        and isinstance(body[2], dict | None)
    ):
        return "a body that is not [args, kwargs, embed]"
    return None


# Headers Celery reads once it has reserved the task (its concurrency slot taken, the request
# counted as reserved) or later, in the worker's event loop, with no handler of ours around:
# one of the wrong type left a worker that took messages and ran none of them ("stamps": 5,
# a TypeError after the reservation), or ended it ("timelimit": ["a", "b"], a ValueError
# once the pool started the task).
TEXT_HEADERS = ("lang", "root_id", "parent_id", "group", "shadow", "origin", "argsrepr", "kwargsrepr", "eta", "expires")


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _wrong_header(headers: dict[str, Any]) -> str | None:
    """What is wrong with a task message's headers, for Celery to run it (None: nothing)."""
    for name in TEXT_HEADERS:
        if not isinstance(headers.get(name), str | None):
            return f"a {name!r} header that is not text"
    limits = headers.get("timelimit")
    if limits is not None and not (
        isinstance(limits, list | tuple) and len(limits) == 2 and all(x is None or _number(x) for x in limits)
    ):
        return "a time limit that is not [soft, hard] in seconds"
    if not isinstance(headers.get("retries"), int | None) or isinstance(headers.get("retries"), bool):
        return "a retry count that is not a whole number"
    stamped = headers.get("stamped_headers")
    if stamped is not None and not (isinstance(stamped, list) and all(isinstance(x, str) for x in stamped)):
        return "stamped headers that are not a list of names"
    if not isinstance(headers.get("stamps"), dict | None):
        return "stamps that are no object"
    return None


def _raw(message: Any) -> bytes:
    """The message as its transport held it: the envelope of a virtual transport (Redis,
    files), else the body."""
    raw = getattr(message, "_raw", None)
    if isinstance(raw, dict):
        return dumps(raw).encode()
    body = message.body
    return body if isinstance(body, bytes) else str(body).encode()


def _queue(message: Any) -> str:
    if queue := delivering_from.get():
        return queue
    info = message.delivery_info
    return str(info.get("routing_key") or "?") if isinstance(info, dict) else "?"


def _keep(message: Any, reason: str) -> None:
    keep = getattr(message.channel, "set_aside", None)
    if keep is not None:
        keep(_queue(message), _raw(message), reason)


def _set_aside_and_ack(consumer: Any, message: Any, reason: str) -> None:
    set_aside(message.channel, _queue(message), _raw(message), reason)
    if not message.acknowledged:
        message.ack_log_error(celery_consumer.logger, consumer.connection_errors)
