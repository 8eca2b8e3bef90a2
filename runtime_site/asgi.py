import os

from django.core.asgi import get_asgi_application

from runtime_site import tracing

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "runtime_site.settings")
# Only the ASGI web process pools its database connections (see settings.RUNTIME_DB_POOL).
os.environ.setdefault("RUNTIME_DB_POOL", "true")
tracing.configure_web()  # before Django loads: it adds its middleware (off without an OTLP endpoint)
get_asgi_application()  # django.setup(), once, before the handlers below load the middleware

from runtime_site.handlers import ByViewKind  # noqa: E402 (needs the settings loaded above)
from runtime_site.middleware import ChunkedBodyASGI  # noqa: E402

application = ChunkedBodyASGI(ByViewKind())
