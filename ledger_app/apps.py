from django.apps import AppConfig


class LedgerAppConfig(AppConfig):
    name = "ledger_app"
    verbose_name = "Ledger"

    def ready(self) -> None:
        from ledger_app import llm, tools  # noqa: F401  (registers the built-in tools and llm.chat)
