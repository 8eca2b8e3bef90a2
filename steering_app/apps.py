from django.apps import AppConfig


class SteeringAppConfig(AppConfig):
    name = "steering_app"
    verbose_name = "Steering"

    def ready(self) -> None:
        # A task that ends settles its pending commands and withdraws its open questions,
        # whichever path ends it: task core calls this from every terminal transition.
        from steering_app.actions import settle_on_end
        from tasks_app.actions import on_task_ended

        on_task_ended(settle_on_end)
