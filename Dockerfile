FROM python:3.12-slim
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
WORKDIR /app
COPY requirements.txt .
RUN pip install -r requirements.txt
COPY . .
# Admin and dashboard static files, served by the web process (whitenoise). Run in the
# embedded profile with a throw-away data folder, so nothing of it stays in the image.
ENV DJANGO_STATIC_ROOT=/app/static
RUN RUNTIME_DATA_DIR=/tmp/build python manage.py collectstatic --noinput -v0 \
    && rm -rf /tmp/build
RUN useradd --create-home runtime && mkdir -p /app/var && chown runtime /app/var
USER runtime
EXPOSE 8000
CMD ["uvicorn", "runtime_site.asgi:application", "--host", "0.0.0.0", "--port", "8000"]
