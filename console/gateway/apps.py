from django.apps import AppConfig
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured


class GatewayConfig(AppConfig):
    name = "console.gateway"
    label = "gateway"
    verbose_name = "Gateway: the OpenAI-compatible API in front of the data plane"

    def ready(self) -> None:
        # the router's settings are checked at start-up, every bad key named, not at the first request
        from console.gateway import learned
        from scheduler.router import RouterConfig

        try:
            RouterConfig.from_dict(getattr(settings, "FLEXPIPE_ROUTER", None))
            learned.policy_name()
            learned.rollout_config()
        except ValueError as exc:
            raise ImproperlyConfigured(str(exc)) from None
