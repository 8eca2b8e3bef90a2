from django.contrib import admin
from django.templatetags.static import static
from django.urls import include, path
from django.views.generic import RedirectView

from mcp_server.views import mcp_endpoint, protected_resource_metadata
from runtime_site import openapi  # (also registers the API's schema extensions)
from runtime_site.errors import allow_methods_under
from runtime_site.health import healthz, read_only, readyz, scrapers_only
from runtime_site.metrics import metrics_view

# The admin is pages and forms: what else comes is the JSON 405 every edge answers.
admin_patterns, admin_app, admin_namespace = admin.site.urls

urlpatterns = [
    path("runtime/", include("tasks_app.api.urls")),
    path("runtime/schema", openapi.SchemaApi.as_view(permission_classes=[], authentication_classes=[]), name="schema"),
    path("admin/", (allow_methods_under(admin_patterns, "GET", "HEAD", "POST"), admin_app, admin_namespace)),
    path("healthz", healthz),
    path("readyz", readyz),
    path("metrics", read_only(scrapers_only(metrics_view))),
    path("mcp", mcp_endpoint, name="mcp"),
    # MCP authorization (RFC 9728): at the root, and at the path-inserted form for /mcp
    path(".well-known/oauth-protected-resource", protected_resource_metadata),
    path(".well-known/oauth-protected-resource/mcp", protected_resource_metadata),
    path("dashboard/", include("dashboard.urls")),
    # Browsers ask every site for one; a JSON 404 shows as a console error on every first page load.
    path("favicon.ico", read_only(RedirectView.as_view(url=static("dashboard/favicon.svg"), permanent=True))),
    path("", read_only(RedirectView.as_view(url="/dashboard/", permanent=False))),
]

handler400 = "runtime_site.errors.json_400"
handler404 = "runtime_site.errors.json_404"
handler500 = "runtime_site.errors.json_500"
