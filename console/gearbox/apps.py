from django.apps import AppConfig


class GearboxConfig(AppConfig):
    name = "console.gearbox"
    label = "gearbox"
    verbose_name = "Gearbox: deployments, decisions and transitions"

    def ready(self) -> None:
        from console.gearbox import receivers  # noqa: F401 - connects the fleet's signals
