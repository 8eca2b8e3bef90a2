"""DATABASES["default"]["ENGINE"] on PostgreSQL: Django's backend, whose connections made
without a pool (a worker's: one per thread, kept between slices) are of the class the
process chose (runtime_site.dbpool.own_connection_class; workers: WorkerConnection, with a
deadline on every round trip). A pool's connections are its connection_class's (settings.py).

Django's docs name subclassing a backend as the way to change how it connects
(https://docs.djangoproject.com/en/stable/ref/databases/#subclassing-the-built-in-database-backends).
Its backend connects with psycopg.connect and takes no connection class but a pool's:
the connection it made becomes one of the chosen class, which overrides a method
(Connection.wait) and holds one attribute of its own, a class default until its notice
handler (hear_fatal, which __init__ would have added) sets it."""

from __future__ import annotations

from typing import Any

from django.db.backends.postgresql import base

from runtime_site import dbpool


class DatabaseWrapper(base.DatabaseWrapper):
    def get_new_connection(self, conn_params: dict[str, Any]) -> Any:
        connection = super().get_new_connection(conn_params)
        chosen = dbpool.own_connection_class
        if chosen is not None and self.pool is None and type(connection) is not chosen:
            # Before Django's first statement on it (the time zone, the role): bounded too.
            connection.__class__ = chosen
            connection.hear_fatal()
        return connection
