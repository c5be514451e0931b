"""The Celery application: broker and settings from Django's settings (CELERY_*)."""

from __future__ import annotations

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "console.settings")

app = Celery("flexpipe")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
