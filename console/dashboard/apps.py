from django.apps import AppConfig


class DashboardConfig(AppConfig):
    name = "console.dashboard"
    label = "dashboard"
    verbose_name = "Operator dashboard"
