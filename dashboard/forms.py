from __future__ import annotations

import uuid
from typing import cast

from django import forms

from common import json_safety
from steering_app.models import COMMAND_ID, CommandType

CHOICE_PRIORITY = [(p, f"{p}{' (most urgent)' if p == 0 else ''}") for p in range(10)]


class StartReviewForm(forms.Form):
    """Start the built-in document_review agent (its input schema validates the rest)."""

    tenant = forms.ChoiceField()
    corpus = forms.CharField(max_length=200, initial="corpora/demo")
    goal = forms.CharField(
        max_length=10_000, required=False, initial="Find risky contracts", widget=forms.TextInput(attrs={"size": 50})
    )
    limit = forms.IntegerField(min_value=1, required=False, initial=200, help_text="documents to review")
    batch_size = forms.IntegerField(min_value=1, max_value=500, initial=20, label="Batch size")
    pacing_ms = forms.IntegerField(
        min_value=0,
        max_value=60_000,
        initial=0,
        label="Pacing (ms per batch)",
        help_text="slows each batch down, to have a run to watch",
    )
    publish = forms.BooleanField(required=False, initial=True, help_text="publish the report (needs an approval)")
    priority = forms.TypedChoiceField(choices=CHOICE_PRIORITY, coerce=int, initial=5)
    # Generated when the form is shown: a double submit is a replay of the same task.
    idempotency_key = forms.CharField(widget=forms.HiddenInput, max_length=200)

    def __init__(self, *args, tenants: list[tuple[str, str]], **kwargs) -> None:
        super().__init__(*args, **kwargs)
        cast(forms.ChoiceField, self.fields["tenant"]).choices = tenants
        if len(tenants) == 1:
            self.fields["tenant"].widget = forms.HiddenInput()
        self.fields["idempotency_key"].initial = f"dash-{uuid.uuid4().hex}"

    def agent_input(self) -> dict:
        data = self.cleaned_data
        body = {
            "corpus": data["corpus"],
            "batchSize": data["batch_size"],
            "pacingMs": data["pacing_ms"],
            "publish": data["publish"],
        }
        if data["limit"]:
            body["limit"] = data["limit"]
        return body


class SteerForm(forms.Form):
    """One steering command with the version of the state the person was looking at."""

    type = forms.ChoiceField(
        choices=[
            (c, c)
            for c in (
                CommandType.PAUSE,
                CommandType.RESUME,
                CommandType.CANCEL,
                CommandType.ADJUST_GOAL,
                CommandType.SET_PRIORITY,
            )
        ]
    )
    expected_version = forms.IntegerField(min_value=1)
    command_id = forms.RegexField(COMMAND_ID)
    reason = forms.CharField(max_length=500, required=False)
    goal = forms.CharField(max_length=10_000, required=False)
    exclude_expired = forms.BooleanField(required=False)
    priority = forms.TypedChoiceField(choices=CHOICE_PRIORITY, coerce=int, required=False, empty_value=None)

    def payload(self) -> dict:
        data = self.cleaned_data
        match data["type"]:
            case CommandType.ADJUST_GOAL:
                body: dict = {}
                if data["goal"]:
                    body["goal"] = data["goal"]
                if data["exclude_expired"]:
                    body["constraints"] = {"excludeExpired": True}
                return body
            case CommandType.SET_PRIORITY:
                return {"priority": data["priority"]}
        return {}


class AnswerForm(forms.Form):
    """An answer to any open question: a button's value (the JSON of an enum value or a
    boolean) or what the person typed, read as JSON when it is JSON and as the text itself
    otherwise ("approve"). The question's schema, checked by the domain, decides the rest."""

    answer = forms.CharField(max_length=10_000, strip=False)
    reason = forms.CharField(max_length=500, required=False)

    def clean_answer(self) -> object:
        text = self.cleaned_data["answer"]
        try:
            return json_safety.loads(text)
        except json_safety.NotJson:
            return text
        except json_safety.UnsafeInput as exc:
            raise forms.ValidationError(str(exc)) from exc
