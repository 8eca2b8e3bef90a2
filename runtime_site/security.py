"""Sign-in throttling for the dashboard and admin (django-axes; settings AXES_*)."""

from __future__ import annotations

from typing import Any

from axes.backends import AxesStandaloneBackend
from django.http import HttpRequest


class SignInThrottleBackend(AxesStandaloneBackend):
    """django-axes' check, for sign-ins that come over HTTP. A sign-in without a request (a
    script, a management command, the test client's login()) is nobody guessing passwords
    over the network; axes would refuse it outright, so it is left to the model backend."""

    def authenticate(
        self, request: HttpRequest | None, username: str | None = None, password: str | None = None, **kwargs: Any
    ) -> Any:
        if request is None:
            return None
        return super().authenticate(request, username, password, **kwargs)
