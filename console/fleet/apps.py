from django.apps import AppConfig


class FleetConfig(AppConfig):
    name = "console.fleet"
    label = "fleet"
    verbose_name = "Fleet: nodes, GPUs and their reports"
