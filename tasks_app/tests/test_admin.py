"""Every model is in the admin, and its pages render for a superuser."""

from __future__ import annotations

import pytest
from django.contrib import admin
from django.contrib.auth import get_user_model

from tasks_app.tests.test_engine import new_task, run_to_end


@pytest.mark.django_db(transaction=True)
def test_admin_lists_render_for_every_registered_model(alice, client):
    run_to_end(new_task(alice, steps=3))
    get_user_model().objects.create_superuser("root", "root@example.com", "pw")
    client.login(username="root", password="pw")
    names = {m._meta.label for m in admin.site._registry}
    assert {"tasks_app.Task", "checkpoints_app.Checkpoint", "steering_app.SteeringCommand",
            "steering_app.InputRequest", "ledger_app.LedgerEntry", "tasks_app.AuditRecord"} <= names
    for model in admin.site._registry:
        url = f"/admin/{model._meta.app_label}/{model._meta.model_name}/"
        assert client.get(url).status_code == 200, url
