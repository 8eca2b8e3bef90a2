"""The settings of a test run: the product's, plus the test fixtures app.

pytest.ini and bin/test name this module in DJANGO_SETTINGS_MODULE, which every process a
test starts (workers, beat, web servers, bin/run) inherits, so they load the fixtures too.
The product never imports tests/: nothing test-only ships or runs in a deployment.
"""

import os

from runtime_site.settings import *  # noqa: F403

INSTALLED_APPS = [*INSTALLED_APPS, "tests.fixtures"]  # noqa: F405

# Every request of a test run comes from 127.0.0.1, and many tests send wrong credentials on
# purpose: counted together they would lock later tests out. The tests of that limit set it
# (tests/test_rate_limits.py); a process a test starts may set LIMITS_AUTH_FAILURES_PER_ADDRESS.
if not os.getenv("LIMITS_AUTH_FAILURES_PER_ADDRESS"):
    RUNTIME["limits"]["auth_failures_per_address"] = 0  # noqa: F405
