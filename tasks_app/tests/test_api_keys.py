"""API key lifecycle over real HTTP (the Django test client): a key stops working the moment
its user is deactivated or leaves the tenant, on REST, /mcp and SSE alike; expiry; scopes
narrower than the role; rotation with two live keys; last-used time written at most once a
minute; the small REST API and the admin that manage keys."""

from __future__ import annotations

import json
import re
from datetime import timedelta

import pytest
from django.contrib.auth import get_user_model
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from conftest import make_persona
from steering_app.models import InputRequest
from tasks_app import engine
from tasks_app.models import ApiKey, Membership, Task
from tasks_app.tests.test_engine import new_task

pytestmark = pytest.mark.django_db


def rest(token: str, method: str = "get", path: str = "/runtime/tasks", body: dict | None = None):
    client = Client(headers={"Authorization": f"Bearer {token}"})
    if body is None:
        return getattr(client, method)(path)
    return getattr(client, method)(path, data=json.dumps(body), content_type="application/json")


def mcp(token: str):
    from mcp_server.protocol import MODERN, TASKS_EXT

    meta = {
        "io.modelcontextprotocol/protocolVersion": MODERN,
        "io.modelcontextprotocol/clientCapabilities": {"extensions": {TASKS_EXT: {}}},
    }
    body = {"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {"_meta": meta}}
    return Client().post(
        "/mcp",
        data=json.dumps(body),
        content_type="application/json",
        headers={
            "Authorization": f"Bearer {token}",
            "Accept": "application/json, text/event-stream",
            "MCP-Protocol-Version": MODERN,
            "Mcp-Method": "tools/list",
        },
    )


def sse(token: str, task: Task):
    """The SSE connect: only its status matters here (a 200 is a stream the test never reads)."""
    response = Client().get(f"/runtime/tasks/{task.id}/events", headers={"Authorization": f"Bearer {token}"})
    if response.streaming:
        response.close()
    return response


def statuses(token: str, task: Task) -> tuple[int, int, int]:
    return rest(token).status_code, mcp(token).status_code, sse(token, task).status_code


# the SSE view closes its connection (pitfall 1), which would end a test transaction
@pytest.mark.django_db(transaction=True)
def test_a_key_stops_working_the_moment_its_user_is_deactivated(alice):
    task = new_task(alice)
    assert statuses(alice.token, task) == (200, 200, 200)
    get_user_model().objects.filter(pk=alice.user.pk).update(is_active=False)
    assert statuses(alice.token, task) == (401, 401, 401)
    assert "deactivated" in rest(alice.token).json()["error"]["message"]


# the SSE view closes its connection (pitfall 1), which would end a test transaction
@pytest.mark.django_db(transaction=True)
def test_a_key_stops_working_the_moment_its_user_leaves_the_tenant(alice):
    task = new_task(alice)
    Membership.objects.filter(user=alice.user, tenant=alice.tenant).delete()
    assert statuses(alice.token, task) == (401, 401, 401)
    assert "no longer a member" in rest(alice.token).json()["error"]["message"]


def test_a_demoted_member_s_key_acts_with_the_lower_role(alice):
    Membership.objects.filter(user=alice.user).update(role="viewer")
    assert rest(alice.token).status_code == 200
    assert rest(alice.token, "post", body={"agent": "noop", "input": {"steps": 1}}).status_code == 403


def test_a_demoted_member_s_key_makes_a_key_of_its_lower_role_by_default(alice):
    """A key (or token) wider than its user's membership acts with the lower role; a key it
    makes by default is of that role, with the scopes that role allows of its own, not a 400
    for carrying scopes beyond the role it defaulted to."""
    made = rest(key := alice.token, "post", "/runtime/keys", {"name": "derived"})
    assert made.status_code == 201, made.content
    Membership.objects.filter(user=alice.user).update(role="viewer")
    made = rest(key, "post", "/runtime/keys", {"name": "after demotion"})
    assert made.status_code == 201, made.content
    assert made.json()["role"] == "viewer" and made.json()["scopes"] == ["read"]


# the SSE view closes its connection (pitfall 1), which would end a test transaction
@pytest.mark.django_db(transaction=True)
def test_an_expired_key_is_refused(alice):
    task = new_task(alice)
    ApiKey.objects.filter(user=alice.user).update(expires_at=timezone.now() - timedelta(seconds=1))
    assert statuses(alice.token, task) == (401, 401, 401)
    assert "expired" in rest(alice.token).json()["error"]["message"]


def test_last_used_is_written_once_a_minute_not_on_every_request(alice):
    key = ApiKey.objects.get(user=alice.user)
    assert key.last_used_at is None
    assert rest(alice.token).status_code == 200
    first = ApiKey.objects.get(pk=key.pk).last_used_at
    assert first is not None
    with CaptureQueriesContext(connection) as queries:
        for _ in range(3):
            assert rest(alice.token).status_code == 200
    assert not [q for q in queries.captured_queries if q["sql"].startswith('UPDATE "tasks_app_apikey"')]
    assert ApiKey.objects.get(pk=key.pk).last_used_at == first
    ApiKey.objects.filter(pk=key.pk).update(last_used_at=first - timedelta(seconds=61))
    assert rest(alice.token).status_code == 200
    assert ApiKey.objects.get(pk=key.pk).last_used_at > first


def make_key(persona, **body) -> dict:
    response = rest(persona.token, "post", "/runtime/keys", {"name": "narrow", **body})
    assert response.status_code == 201, response.content
    return response.json()


def test_a_read_scoped_key_reads_but_cannot_start_or_steer(alice):
    read = make_key(alice, scopes=["read"])
    assert read["scopes"] == ["read"] and read["role"] == "operator"
    assert rest(read["token"]).status_code == 200
    started = rest(read["token"], "post", body={"agent": "noop", "input": {"steps": 1}})
    assert started.status_code == 403
    # and it cannot mint itself a wider key
    wider = rest(read["token"], "post", "/runtime/keys", {"name": "wider", "scopes": ["read", "operate"]})
    assert wider.status_code == 400 and "beyond this key" in wider.json()["error"]["message"]
    assert rest(alice.token, "post", "/runtime/keys", {"name": "x", "role": "admin"}).status_code == 400


def waiting_task(persona, kind: str) -> tuple[Task, str]:
    """A task stopped at an input request of this kind (the noop agent asks "continue")."""
    task = new_task(persona, steps=6)
    Task.objects.filter(id=task.id).update(input={"steps": 6, "askAt": 3})
    engine.run_slice(task.id, worker_id="w1")
    InputRequest.objects.filter(task_id=task.id, key="continue").update(kind=kind)
    return task, "continue"


def test_an_approve_scoped_key_approves_but_cannot_operate(alice):
    april = make_persona("acme", "april", "approver")
    approve = make_key(april, scopes=["approve"])
    assert rest(approve["token"], "post", body={"agent": "noop", "input": {"steps": 1}}).status_code == 403
    question, key = waiting_task(alice, "question")
    assert (
        rest(approve["token"], "post", f"/runtime/tasks/{question.id}/inputs/{key}", {"answer": True}).status_code
        == 403
    )
    approval, key = waiting_task(alice, "approval")
    answered = rest(approve["token"], "post", f"/runtime/tasks/{approval.id}/inputs/{key}", {"answer": True})
    assert answered.status_code == 202, answered.content
    # an operator-only key may not approve
    operate = make_key(alice, scopes=["operate"])
    other, key = waiting_task(alice, "approval")
    assert (
        rest(operate["token"], "post", f"/runtime/tasks/{other.id}/inputs/{key}", {"answer": True}).status_code == 403
    )


def test_a_narrower_key_cannot_rotate_a_wider_one_into_its_own_hands(alice):
    """Rotation makes a key with the rotated key's grant and hands its token to the caller:
    a read-only key rotating its user's full key got a working operator key, and a key that
    expires tomorrow a key that never does."""
    full = ApiKey.objects.get(user=alice.user)
    tomorrow = (timezone.now() + timedelta(days=1)).isoformat()
    for narrow in (make_key(alice, scopes=["read"]), make_key(alice, expiresAt=tomorrow)):
        refused = rest(narrow["token"], "post", f"/runtime/keys/{full.prefix}/rotate")
        assert refused.status_code == 403, refused.content
        assert ApiKey.objects.filter(rotated_from=full).count() == 0
        assert ApiKey.objects.get(pk=full.pk).expires_at is None  # the old key was left alone
    # a key rotates itself, and a wider key a narrower one
    assert rest(alice.token, "post", f"/runtime/keys/{narrow['id']}/rotate").status_code == 201
    assert rest(alice.token, "post", f"/runtime/keys/{full.prefix}/rotate").status_code == 201


def test_a_tenant_admin_cannot_rotate_another_user_s_key_into_their_own_hands(alice, settings):
    """Rotating answers with the new token: an admin rotating an approver's key held a key
    acting as that approver (the audit's actor), and approved the guarded calls of a task
    the admin started although approver_not_creator forbids it. Others' keys an admin may
    list and revoke; only their holder rotates them."""
    settings.RUNTIME = {**settings.RUNTIME, "security": {**settings.RUNTIME["security"], "approver_not_creator": True}}
    ada, april = make_persona("acme", "ada", "admin"), make_persona("acme", "april", "approver")
    task, key = waiting_task(ada, "approval")
    Task.objects.filter(id=task.id).update(created_by=f"user:{ada.user.pk}")
    assert rest(ada.token, "post", f"/runtime/tasks/{task.id}/inputs/{key}", {"answer": True}).status_code == 403
    aprils = ApiKey.objects.get(user=april.user)
    rotated = rest(ada.token, "post", f"/runtime/keys/{aprils.prefix}/rotate")
    assert rotated.status_code == 403, rotated.content
    assert "token" not in rotated.json() and not ApiKey.objects.filter(rotated_from=aprils).exists()
    assert aprils.prefix in {k["id"] for k in rest(ada.token, path="/runtime/keys").json()["keys"]}
    assert rest(ada.token, "delete", f"/runtime/keys/{aprils.prefix}").status_code == 200
    assert rest(april.token).status_code == 401


def test_a_key_that_expires_cannot_make_one_that_outlives_it(alice):
    """A child is at most as wide as its maker in time too: by default it expires with it."""
    ends = timezone.now() + timedelta(days=1)
    short = make_key(alice, expiresAt=ends.isoformat())["token"]
    later = rest(short, "post", "/runtime/keys", {"name": "later", "expiresAt": (ends + timedelta(days=1)).isoformat()})
    assert later.status_code == 400 and "outlive" in later.json()["error"]["message"], later.content
    child = rest(short, "post", "/runtime/keys", {"name": "child"})
    assert child.status_code == 201 and ApiKey.objects.get(prefix=child.json()["id"]).expires_at == ends
    sooner = rest(
        short, "post", "/runtime/keys", {"name": "sooner", "expiresAt": (ends - timedelta(hours=1)).isoformat()}
    )
    assert sooner.status_code == 201


def test_a_key_without_the_read_scope_cannot_open_a_stream(alice):
    """Reading streams is the read scope's, as reading tasks over REST is."""
    task = new_task(alice, steps=1)
    april = make_persona("acme", "april", "approver")
    for scopes in (["operate"], ["approve"]):
        key = make_key(april, scopes=scopes)
        response = rest(key["token"], path=f"/runtime/tasks/{task.id}/events")
        assert response.status_code == 403 and response.json()["error"]["code"] == "permission_denied", scopes
        assert rest(key["token"], path=f"/runtime/tasks/{task.id}").status_code == 403  # as REST
    reader = rest(make_key(april, scopes=["read"])["token"], path=f"/runtime/tasks/{task.id}/events")
    assert reader.status_code == 200 and reader.streaming
    reader.close()


def test_rotation_keeps_two_keys_live_until_the_old_one_expires(alice, settings):
    settings.RUNTIME = {
        **settings.RUNTIME,
        "security": {**settings.RUNTIME["security"], "key_rotation_grace_seconds": 3600},
    }
    old = ApiKey.objects.get(user=alice.user)
    rotated = rest(alice.token, "post", f"/runtime/keys/{old.prefix}/rotate")
    assert rotated.status_code == 201, rotated.content
    body = rotated.json()
    assert body["rotatedFrom"] == old.prefix and body["previous"]["expiresAt"] is not None
    expires = ApiKey.objects.get(pk=old.pk).expires_at
    assert timedelta(minutes=59) < expires - timezone.now() <= timedelta(hours=1)
    assert rest(alice.token).status_code == 200 and rest(body["token"]).status_code == 200  # both live
    ApiKey.objects.filter(pk=old.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
    assert rest(alice.token).status_code == 401 and rest(body["token"]).status_code == 200


def test_the_keys_api_lists_revokes_and_hides_other_users_keys(alice, victor, mallory):
    mine = make_key(alice, scopes=["read"], expiresAt=(timezone.now() + timedelta(days=1)).isoformat())
    assert "token" not in rest(alice.token, path="/runtime/keys").json()["keys"][0]
    listed = {k["id"] for k in rest(alice.token, path="/runtime/keys").json()["keys"]}
    victors = ApiKey.objects.get(user=victor.user).prefix
    assert mine["id"] in listed and victors not in listed
    assert rest(alice.token, "delete", f"/runtime/keys/{victors}").status_code == 404
    assert rest(mallory.token, "delete", f"/runtime/keys/{mine['id']}").status_code == 404  # another tenant
    assert rest(mine["token"]).status_code == 200
    revoked = rest(alice.token, "delete", f"/runtime/keys/{mine['id']}")
    assert revoked.status_code == 200 and revoked.json()["revokedAt"] is not None
    assert rest(mine["token"]).status_code == 401
    past = rest(alice.token, "post", "/runtime/keys", {"name": "old", "expiresAt": "2020-01-01T00:00:00Z"})
    assert past.status_code == 400 and "future" in past.json()["error"]["message"]
    admin = make_persona("acme", "ada", "admin")
    assert victors in {k["id"] for k in rest(admin.token, path="/runtime/keys").json()["keys"]}


def test_a_key_name_that_is_not_a_string_is_refused_naming_it(alice):
    """DRF's CharField took 5 as "5": a key was stored with a name the client never sent as
    text. The served schema says string, so any other JSON type is the 400 it promises."""
    before = ApiKey.objects.count()
    for name in (5, 2.5, True, None, ["a"], {"a": 1}):
        response = rest(alice.token, "post", "/runtime/keys", {"name": name})
        assert response.status_code == 400, (name, response.status_code, response.content)
        assert list(response.json()["error"]["fields"]) == ["name"], (name, response.json())
    assert ApiKey.objects.count() == before
    assert rest(alice.token, "post", "/runtime/keys", {"name": "ci"}).json()["name"] == "ci"


def test_the_admin_makes_a_key_showing_its_token_once_and_rotates_and_revokes(alice):
    staff = get_user_model().objects.create_superuser("root", "root@example.com", "pw-root-123")
    browser = Client()
    browser.force_login(staff)
    added = browser.post(
        "/admin/tasks_app/apikey/add/",
        {"tenant": alice.tenant.pk, "user": alice.user.pk, "role": "viewer", "name": "exporter", "scopes": ["read"]},
        follow=True,
    )
    assert added.status_code == 200
    token = re.search(r"rt_[0-9a-f]{12}_[A-Za-z0-9_\-]+", added.content.decode()).group(0)
    assert rest(token).status_code == 200
    assert rest(token, "post", body={"agent": "noop", "input": {"steps": 1}}).status_code == 403
    key = ApiKey.objects.get(name="exporter")
    rotated = browser.post("/admin/tasks_app/apikey/", {"action": "rotate", "_selected_action": [key.pk]}, follow=True)
    new_token = re.search(r"rt_[0-9a-f]{12}_[A-Za-z0-9_\-]+", rotated.content.decode()).group(0)
    assert new_token != token and rest(new_token).status_code == 200 and rest(token).status_code == 200
    browser.post("/admin/tasks_app/apikey/", {"action": "revoke", "_selected_action": [key.pk]}, follow=True)
    assert rest(token).status_code == 401 and rest(new_token).status_code == 200
    wide = browser.post(
        "/admin/tasks_app/apikey/add/",
        {"tenant": alice.tenant.pk, "user": alice.user.pk, "role": "viewer", "name": "wide", "scopes": ["approve"]},
    )
    assert wide.status_code == 200 and "beyond the viewer role" in wide.content.decode()


def test_the_key_read_written_out_reads_what_the_orm_reads(alice):
    from tasks_app.auth import _member_role, issue_api_key, read_key

    key = ApiKey.objects.get(prefix=alice.token.split("_")[1])
    scoped = issue_api_key(alice.tenant, key.user, role="approver", name="narrow", scopes=["read", "approve"])[0]
    Membership.objects.filter(user=key.user).update(role="approver")  # the membership's role differs from the key's
    for prefix in (key.prefix, scoped.prefix):
        by_orm = ApiKey.objects.select_related("tenant", "user").annotate(member_role=_member_role()).get(prefix=prefix)
        by_hand = read_key(prefix)
        assert by_hand is not None
        for name in ("id", "tenant_id", "user_id", "role", "prefix", "key_hash", "scopes", "expires_at", "revoked_at"):
            assert getattr(by_hand, name) == getattr(by_orm, name), name
        assert isinstance(by_hand.scopes, list)  # decoded, not JSON text
        assert by_hand.member_role == by_orm.member_role == "approver"
        for name in ("id", "username", "is_active", "is_staff", "email", "date_joined"):
            assert getattr(by_hand.user, name) == getattr(by_orm.user, name), name
        assert by_hand.tenant.slug == by_orm.tenant.slug and by_hand.tenant.name == by_orm.tenant.name
    assert read_key("nosuchprefix") is None


@pytest.mark.parametrize(
    ("method", "suffix"), [("get", ""), ("delete", ""), ("post", "/rotate")], ids=["read", "revoke", "rotate"]
)
def test_a_key_id_that_is_malformed_unknown_or_not_the_caller_s_is_no_such_key(alice, victor, method, suffix):
    victors = ApiKey.objects.get(user=victor.user).prefix
    for key_id in ("zzz", "0" * 12, "x" * 300, "%C3%A9-", victors):
        response = rest(alice.token, method, f"/runtime/keys/{key_id}{suffix}")
        assert response.status_code == 404, (key_id, response.content)
        assert response.json()["error"] == {
            "code": "not_found",
            "message": "no such key among those this key may manage",
        }, key_id
    assert ApiKey.objects.get(prefix=victors).revoked_at is None


def test_a_viewer_and_a_narrow_key_of_an_admin_list_only_their_own_user_s_keys(alice, victor):
    """Roles (DESIGN §3): managing the tenant's keys is an admin's; anyone else, and an
    admin's key narrowed to a lower role or to reading, sees only its own user's keys."""
    make_key(alice)
    ada = make_persona("acme", "ada", "admin")
    for token in (victor.token, make_key(ada, role="viewer")["token"], make_key(ada, scopes=["read"])["token"]):
        listed = rest(token, path="/runtime/keys").json()["keys"]
        assert len({k["userId"] for k in listed}) == 1, listed
    everyone = {k["userId"] for k in rest(ada.token, path="/runtime/keys").json()["keys"]}
    assert everyone == {alice.user.pk, victor.user.pk, ada.user.pk}


def test_every_statement_a_keyed_request_hands_the_cursor_is_text(alice):
    # An execute_wrapper or a tracing instrumentation reads the SQL as a string (the
    # operation's name from its first word): psycopg's Composed broke them with a 500.
    seen: list[type] = []

    def wrapper(execute, sql, params, many, context):
        seen.append(type(sql))
        return execute(sql, params, many, context)

    with connection.execute_wrapper(wrapper):
        assert rest(alice.token).status_code == 200
    assert seen and set(seen) == {str}
