"""Django's PostgreSQL backend, with the class of the connections it makes itself chosen by
the process (runtime_site.dbpool.own_connection_class): a worker's have a deadline on every
round trip. ENGINE in settings.py; Django finds DatabaseWrapper in base.py."""
