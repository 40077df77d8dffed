"""``import smpart`` stays cheap: what only some users need is imported when they first use it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

_PROBE = """
import sys, smpart
heavy = ("torch.distributed.tensor", "torch.distributed.checkpoint")
print([name for name in heavy if name in sys.modules])
print(smpart.save_checkpoint.__module__, smpart.load_weights.__module__, "load_checkpoint" in dir(smpart))
print([name for name in heavy if name in sys.modules])
print(smpart.nn.DistributedLinear.__name__, smpart.amp.GradScaler.__module__, {"nn", "amp"} <= {*dir(smpart)})
print("smpart.viz" in sys.modules, smpart.show.__module__, smpart.to_html.__module__, "show" in dir(smpart))
"""


@pytest.mark.timeout(120)
def test_dtensor_and_checkpoints_are_imported_at_first_use():
    done = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=100,
                          cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0, done.stderr
    before, api, after, modules, views = done.stdout.splitlines()
    assert before == "[]"  # ~1.4 s of the import, not paid by a script that splits no layer
    assert api == "smpart.checkpoint.save smpart.checkpoint.weights True"
    assert after == "['torch.distributed.tensor', 'torch.distributed.checkpoint']"
    # the public modules answer after a plain ``import smpart`` (smpart.nn needed its own import)
    assert modules == "DistributedLinear smpart.runtime.grad_scaler True"
    # the views (rich's console) too: smpart.show and smpart.to_html import them when first used
    assert views == "False smpart.viz.terminal smpart.viz.html True"


def test_an_unknown_attribute_is_still_an_attribute_error():
    import smpart

    with pytest.raises(AttributeError, match="no_such_thing"):
        smpart.no_such_thing  # noqa: B018
