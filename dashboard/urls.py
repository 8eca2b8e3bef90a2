from django.contrib.auth import views as auth_views
from django.urls import path

from dashboard import views
from runtime_site.errors import allow_methods

app_name = "dashboard"

urlpatterns = [
    path("", views.task_list, name="tasks"),
    path("tasks.json", views.task_list_json, name="tasks-json"),
    path("tasks/new", views.start_task, name="start"),
    path("tasks/<uuid:task_id>/", views.task_page, name="task"),
    path("tasks/<uuid:task_id>/panels", views.task_panels, name="task-panels"),
    path("tasks/<uuid:task_id>/snapshot", views.task_snapshot_json, name="task-snapshot"),
    path("tasks/<uuid:task_id>/steer", views.steer, name="steer"),
    path("tasks/<uuid:task_id>/artifacts/<str:name>", views.artifact, name="artifact"),
    path("tasks/<uuid:task_id>/inputs/<str:key>", views.answer, name="answer"),
    path(
        "login/",
        allow_methods("GET", "HEAD", "POST")(auth_views.LoginView.as_view(template_name="dashboard/login.html")),
        name="login",
    ),
    path("logout/", allow_methods("POST")(auth_views.LogoutView.as_view(next_page="/dashboard/login/")), name="logout"),
]
