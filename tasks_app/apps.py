from django.apps import AppConfig


class TasksAppConfig(AppConfig):
    name = "tasks_app"
    verbose_name = "Tasks"

    def ready(self) -> None:
        # Built-in agents register themselves on import.
        from runtime_site.patches import eventstream
        from tasks_app import agents  # noqa: F401

        eventstream.install()
