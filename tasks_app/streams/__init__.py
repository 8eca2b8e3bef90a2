"""Live progress over SSE (DESIGN §7): publish.py stores and rings, wakeups.py wakes the
streams of this web process; the view is tasks_app/api/sse.py."""
