from django.apps import AppConfig


class CheckpointsAppConfig(AppConfig):
    name = "checkpoints_app"
    verbose_name = "Checkpoints"
