from django.apps import AppConfig


class LedgerAppConfig(AppConfig):
    name = "ledger_app"
    verbose_name = "Ledger"

    def ready(self) -> None:
        import tasks_app.agents  # noqa: F401  (the built-in agents, before any plugin: a plugin may not take their names)
        from ledger_app import llm, tools  # noqa: F401  (registers the built-in tools and llm.chat)
        from tasks_app import plugins

        plugins.load()
