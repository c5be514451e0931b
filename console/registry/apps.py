from django.apps import AppConfig


class RegistryConfig(AppConfig):
    name = "console.registry"
    label = "registry"
    verbose_name = "Model registry: weights by SHA256, tokenizer, warm-up"

    def ready(self) -> None:
        # The agents' weight checks arrive as acks of `verify_weights` commands (console.fleet).
        from console.registry import receivers

        receivers.connect()
