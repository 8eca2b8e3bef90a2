import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "runtime_site.settings")
# Only the ASGI web process pools its database connections (see settings.RUNTIME_DB_POOL).
os.environ.setdefault("RUNTIME_DB_POOL", "true")
application = get_asgi_application()
