from django.urls import path

from steering_app.api.views import TaskInputApi, TaskSteeringApi
from tasks_app.api import keys, sse, views

urlpatterns = [
    path("tasks", views.TaskListCreateApi.as_view(), name="tasks"),
    path("tasks/<str:task_id>", views.TaskDetailApi.as_view(), name="task-detail"),
    path("tasks/<str:task_id>/cancel", views.TaskCancelApi.as_view(), name="task-cancel"),
    path("tasks/<str:task_id>/checkpoints", views.TaskCheckpointsApi.as_view(), name="task-checkpoints"),
    path("tasks/<str:task_id>/result", views.TaskResultApi.as_view(), name="task-result"),
    path("tasks/<str:task_id>/audit", views.TaskAuditApi.as_view(), name="task-audit"),
    path("tasks/<str:task_id>/events", sse.task_events, name="task-events"),
    path("tasks/<str:task_id>/steering", TaskSteeringApi.as_view(), name="task-steering"),
    path("tasks/<str:task_id>/inputs/<str:key>", TaskInputApi.as_view(), name="task-input"),
    path("keys", keys.KeyListCreateApi.as_view(), name="keys"),
    path("keys/<str:key_id>", keys.KeyDetailApi.as_view(), name="key-detail"),
    path("keys/<str:key_id>/rotate", keys.KeyRotateApi.as_view(), name="key-rotate"),
]
