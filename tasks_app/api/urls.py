from django.urls import path

from runtime_site.lean import lean
from steering_app.api.views import TaskInputApi, TaskSteeringApi
from tasks_app.api import artifacts, keys, sse, views
from tasks_app.api import lean as lean_views

urlpatterns = [
    path("tasks", views.TaskListCreateApi.as_view(), name="tasks"),
    path("tasks/<str:task_id>", lean(lean_views.task_detail)(views.TaskDetailApi.as_view()), name="task-detail"),
    path("tasks/<str:task_id>/cancel", views.TaskCancelApi.as_view(), name="task-cancel"),
    path("tasks/<str:task_id>/checkpoints", views.TaskCheckpointsApi.as_view(), name="task-checkpoints"),
    path("tasks/<str:task_id>/result", views.TaskResultApi.as_view(), name="task-result"),
    path("tasks/<str:task_id>/audit", views.TaskAuditApi.as_view(), name="task-audit"),
    path("tasks/<str:task_id>/artifacts", artifacts.TaskArtifactsApi.as_view(), name="task-artifacts"),
    path("tasks/<str:task_id>/artifacts/<str:name>", artifacts.TaskArtifactApi.as_view(), name="task-artifact"),
    path("tasks/<str:task_id>/events", lean(sse.lean_task_events)(sse.task_events), name="task-events"),
    path("tasks/<str:task_id>/steering", TaskSteeringApi.as_view(), name="task-steering"),
    path("tasks/<str:task_id>/inputs/<str:key>", TaskInputApi.as_view(), name="task-input"),
    path("keys", keys.KeyListCreateApi.as_view(), name="keys"),
    path("keys/<str:key_id>", keys.KeyDetailApi.as_view(), name="key-detail"),
    path("keys/<str:key_id>/rotate", keys.KeyRotateApi.as_view(), name="key-rotate"),
]
