"""Live progress over SSE (DESIGN §7): publish.py stores and rings, wakeups.py brings the
events to this web process, hub.py fans them out to its streams; the view is tasks_app/api/sse.py."""
