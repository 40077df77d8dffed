"""Shared test set-up.

Under CI (``CI`` set, as ``.ci/run`` runs) hypothesis draws the same examples every run, so a
landing never depends on luck; local runs stay random and keep exploring.
"""

import os

from hypothesis import settings

settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")
