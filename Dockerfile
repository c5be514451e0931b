# The control plane image (web, Celery worker and beat, the simulated fleet). GPU nodes run the
# agent from the same code base on their own hosts (see README: "Run on real GPUs").
FROM python:3.11-slim-bookworm
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /app
COPY requirements.txt .
# The control plane needs torch only for the reference engine's imports: take the CPU build.
RUN pip install --no-cache-dir --extra-index-url https://download.pytorch.org/whl/cpu -r requirements.txt
COPY . .
RUN useradd --create-home flexpipe && chown -R flexpipe /app
USER flexpipe
EXPOSE 8000
CMD ["daphne", "-b", "0.0.0.0", "-p", "8000", "console.asgi:application"]
