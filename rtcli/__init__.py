"""rt: a small command-line client over the runtime's REST API and SSE stream."""
