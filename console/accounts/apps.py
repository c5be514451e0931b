from django.apps import AppConfig


class AccountsConfig(AppConfig):
    name = "console.accounts"
    label = "accounts"
    verbose_name = "Accounts: roles and API tokens"

    def ready(self) -> None:
        from console.accounts import schema  # noqa: F401 - registers the token scheme with drf-spectacular
