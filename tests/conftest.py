"""Shared test set-up.

Under CI (``CI`` set, as ``.ci/run`` runs) hypothesis draws the same examples every run, so a
landing never depends on luck; local runs stay random and keep exploring.
"""

import os
import threading
import time

import pytest
from hypothesis import settings

settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")


@pytest.fixture(autouse=True)
def _no_smpart_thread_left_behind():
    """Every test ends with smpart shut down and none of its threads alive: the one fresh-runtime
    fixture, so no test file needs its own."""
    yield
    import smpart

    smpart.shutdown()
    deadline = time.monotonic() + 5
    while (left := [t.name for t in threading.enumerate() if t.name.startswith("smpart")]) and \
            time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left, f"smpart threads still alive after the test: {left}"


def pytest_collection_modifyitems(config, items):
    """The tests given the longest deadlines start first (a stable sort: the rest keep their
    order), so that with two workers (`make test`) the suite does not end on one long
    multi-process test while the other worker has nothing left to run."""

    def deadline(item) -> float:
        mark = item.get_closest_marker("timeout")
        return mark.args[0] if mark is not None and mark.args else 0

    items.sort(key=deadline, reverse=True)
