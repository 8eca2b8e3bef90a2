from django.apps import AppConfig


class SteeringAppConfig(AppConfig):
    name = "steering_app"
    verbose_name = "Steering"
