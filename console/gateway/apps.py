from django.apps import AppConfig


class GatewayConfig(AppConfig):
    name = "console.gateway"
    label = "gateway"
    verbose_name = "Gateway: the OpenAI-compatible API in front of the data plane"
