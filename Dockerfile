FROM python:3.12-slim
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 RUNTIME_LOG_FORMAT=json
WORKDIR /app
COPY requirements.txt .
RUN pip install -r requirements.txt
COPY . .
# Admin and dashboard static files, served by the web process (whitenoise). Run in the
# embedded profile with a throw-away data folder, so nothing of it stays in the image.
ENV DJANGO_STATIC_ROOT=/app/static
RUN RUNTIME_DATA_DIR=/tmp/build python manage.py collectstatic --noinput -v0 \
    && rm -rf /tmp/build
# Not root: the code and static files stay root's (read-only to the process); only the data folder is its own.
RUN useradd --create-home --uid 10001 runtime && mkdir -p /app/var && chown runtime /app/var
USER runtime
EXPOSE 8000
# The web process (the default command) is up; compose checks readiness (/readyz) and gives
# workers their own check.
HEALTHCHECK --interval=15s --timeout=5s --start-period=20s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/healthz', timeout=4)"]
CMD ["uvicorn", "runtime_site.asgi:application", "--host", "0.0.0.0", "--port", "8000"]
