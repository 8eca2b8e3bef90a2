FROM python:3.12-slim
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
WORKDIR /app
COPY requirements.txt .
RUN pip install -r requirements.txt
COPY . .
RUN useradd --create-home runtime && mkdir -p /app/var && chown runtime /app/var
USER runtime
EXPOSE 8000
CMD ["uvicorn", "runtime_site.asgi:application", "--host", "0.0.0.0", "--port", "8000"]
