from django.apps import AppConfig


class AuditConfig(AppConfig):
    name = "console.audit"
    label = "audit"
    verbose_name = "Audit log (append-only, hash-chained)"
