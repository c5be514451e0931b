from django.apps import AppConfig


class GearboxConfig(AppConfig):
    name = "console.gearbox"
    label = "gearbox"
    verbose_name = "Gearbox: deployments, decisions and transitions"

    def ready(self) -> None:
        from console.gearbox import checks, receivers  # noqa: F401 - the loops' checks; the fleet's signals
