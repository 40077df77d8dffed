"""The `smpart` command line, driven through `smpart.cli.main` (no subprocess)."""

from __future__ import annotations

import sys
import textwrap

import pytest

from smpart.cli import main
from smpart.partitioning.result import Partition

FIXTURE = textwrap.dedent(
    """
    import torch
    from torch import nn

    def mlp():
        model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
        return model, (torch.randn(2, 8),)

    def not_a_model():
        return 42

    def broken():
        raise RuntimeError("no weights here")
    """
)


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """A user's own factory module in the current directory, as `smpart partition mine:mlp` sees it."""
    (tmp_path / "smpart_cli_fixture.py").write_text(FIXTURE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    yield "smpart_cli_fixture"
    sys.modules.pop("smpart_cli_fixture", None)


def test_partition_prints_tree_and_table_and_writes_json(tmp_path, capsys) -> None:
    out = tmp_path / "part.json"
    code = main(
        ["partition", "examples.models:gpt2", "--stages", "4", "--memory-weight", "0.5",
         "--pin", "lm_head=3", "--json", str(out)]
    )
    assert code == 0
    text = capsys.readouterr().out
    for needle in ("stage 0", "stage 3", "lm_head", "Block", "c_attn", "imbalance"):
        assert needle in text
    part = Partition.from_json(str(out))
    assert part.num_stages == 4 and part.memory_weight == 0.5
    assert part.stage_of("lm_head") == part.stage_of("transformer.wte") == 3
    assert part.meta["model"] == "examples.models:gpt2"


def test_partition_on_devices_names_them(tmp_path, capsys) -> None:
    out = tmp_path / "part.json"
    assert main(["partition", "examples.models:gpt2", "--stages", "2", "--devices", "T4, H100",
                 "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert all(word in text for word in ("T4 (65", "H100 (989", "TFLOPS", "time"))
    assert [d.name for d in Partition.from_json(str(out)).devices] == ["T4", "H100"]


def test_show_prints_a_saved_partition(tmp_path, capsys) -> None:
    out = tmp_path / "part.json"
    assert main(["partition", "examples.models:gpt2", "--stages", "2", "--json", str(out)]) == 0
    capsys.readouterr()
    assert main(["show", str(out), "--max-depth", "2"]) == 0
    text = capsys.readouterr().out
    assert "stage 1" in text and "ModuleList" in text


def test_trace_prints_the_costed_tree(capsys) -> None:
    assert main(["trace", "examples.models:gpt2"]) == 0
    text = capsys.readouterr().out
    assert "c_attn" in text and "Block" in text and "parameters" in text


def test_a_users_factory_returning_a_tuple(user_module, capsys) -> None:
    assert main(["partition", f"{user_module}:mlp", "--stages", "3", "--memory-weight", "0"]) == 0
    text = capsys.readouterr().out
    assert "stage 2" in text and "Linear" in text


@pytest.mark.timeout(120)
def test_demo_trains_and_saves_a_timeline(capsys) -> None:
    assert main(["demo", "--steps", "3"]) == 0
    out = capsys.readouterr().out
    assert "stage 1" in out and "timeline" in out.lower()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["partition", "examples.models"], "expected MODULE:FACTORY"),
        (["partition", "no_such_module_xyz:f"], "cannot import 'no_such_module_xyz'"),
        (["partition", "examples.models:nope"], "has no function 'nope'"),
        (["partition", "examples.models:gpt2", "--stages", "0"], "at least 1"),
        (["partition", "examples.models:gpt2", "--pin", "lm_head"], "MODULE=STAGE"),
        (["partition", "examples.models:gpt2", "--pin", "lm_haed=1"], "did you mean 'lm_head'"),
        (["show", "/nonexistent/part.json"], "No such file"),
        (["partition", "examples.models:gpt2", "--stages", "2", "--devices", "V100"], "1 device type(s)"),
    ],
)
def test_bad_input_is_one_red_line_and_exit_2(argv, message, capsys) -> None:
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert message in captured.err
    assert "Traceback" not in captured.err + captured.out
    assert len(captured.err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    ("factory", "message"), [("not_a_model", "returned int"), ("broken", "no weights here")]
)
def test_bad_user_factory_exits_2(user_module, factory, message, capsys) -> None:
    assert main(["trace", f"{user_module}:{factory}"]) == 2
    assert message in capsys.readouterr().err
