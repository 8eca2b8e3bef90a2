"""The settings of a test run: the product's, plus the test fixtures app.

pytest.ini and bin/test name this module in DJANGO_SETTINGS_MODULE, which every process a
test starts (workers, beat, web servers, bin/run) inherits, so they load the fixtures too.
The product never imports tests/: nothing test-only ships or runs in a deployment.
"""

from runtime_site.settings import *  # noqa: F403

INSTALLED_APPS = [*INSTALLED_APPS, "tests.fixtures"]  # noqa: F405
