"""The explorer's data side: what `smpart.viz.html` embeds, checked without a browser.

The page can only be as right as its data: the embedded grid must decode to exactly the
partitions the partitioner returns, the JSON must be inert inside ``<script>``, and the
duck-typed timeline / plans inputs must be read the way their owners write them.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import pytest
from hypothesis import given
from hypothesis import strategies as st

from smpart.cli import main
from smpart.errors import ConfigError, PartitionError
from smpart.partitioning.api import partition
from smpart.tracing.tree import ModuleTree
from smpart.viz.html import (
    embed_json,
    explorer_data,
    plan_table,
    run_length,
    timeline_events,
    to_html,
)


def chain_tree(n: int = 12) -> ModuleTree:
    """A root with ``n`` layers whose compute grows while their memory shrinks: the weight matters."""
    layers = [
        {"name": f"layer{i}", "class_name": "Linear", "flops": 10 + 5 * i, "param_bytes": 400 - 25 * i,
         "children": [{"name": f"layer{i}.act", "class_name": "GELU", "flops": 1, "activation_bytes": 8}]}
        for i in range(n)
    ]
    return ModuleTree.from_spec({"name": "", "class_name": "Net", "children": layers})


def embedded(page: str) -> dict:
    match = re.search(r'<script type="application/json" id="smpart-data">(.*?)</script>', page, re.S)
    assert match, "the page embeds its data"
    return json.loads(match.group(1))


def decode(runs: list[int]) -> list[int]:
    return [stage for stage, count in zip(runs[::2], runs[1::2], strict=True) for _ in range(count)]


# ==================================================================== the grid
def test_grid_decodes_to_the_partitioners_answers() -> None:
    tree = chain_tree()
    data = embedded(to_html(partition(tree, 3, memory_weight=0.5)))
    grid = data["grid"]
    assert grid["weights"] == [round(0.1 * i, 1) for i in range(11)] and grid["stages"] == list(range(1, 9))
    assert len(grid["parts"]) == 88 and grid["note"] is None
    order = data["tree"]["name"]
    assert order == [n.name for n in tree.nodes()]
    for part in grid["parts"]:
        expected = partition(tree, part["s"], memory_weight=part["w"])
        assert decode(part["runs"]) == [expected.node_stage[name] for name in order], (part["w"], part["s"])
        assert part["cut"] == expected.cut_bytes()


def test_grid_keeps_the_users_pins_where_they_fit() -> None:
    tree = chain_tree()
    data = explorer_data(partition(tree, 4, memory_weight=0.3, pin={"layer0": 3}), tree=None,
                         grid={"memory_weights": [0.3], "stages": [2, 4]})
    order = data["tree"]["name"]
    by_stages = {p["s"]: decode(p["runs"]) for p in data["grid"]["parts"]}
    assert by_stages[4][order.index("layer0")] == 3  # pinned, as in the user's partition
    assert by_stages[2] == [partition(tree, 2, memory_weight=0.3).node_stage[n] for n in order]


def test_grid_accepts_pairs_ready_partitions_or_nothing() -> None:
    tree = chain_tree()
    base = partition(tree, 2)
    pairs = explorer_data(base, grid=[(0.25, 3), [1, 2]])["grid"]
    assert sorted((p["w"], p["s"]) for p in pairs["parts"]) == [(0.25, 3), (1.0, 2)]
    ready = explorer_data(base, grid=[partition(tree, 5, memory_weight=0.7)])["grid"]
    assert [(p["w"], p["s"]) for p in ready["parts"]] == [(0.7, 5)]
    assert explorer_data(base, grid=False)["grid"]["parts"] == []
    with pytest.raises(ConfigError, match="outside 0..1"):
        explorer_data(base, grid=[(1.5, 2)])
    with pytest.raises(ConfigError, match="memory_weights"):
        explorer_data(base, grid={"stages": [2]})


def test_grid_points_that_cannot_be_cut_are_reported_not_fatal() -> None:
    tree = chain_tree(3)
    data = explorer_data(partition(tree, 2), grid={"memory_weights": [0.5], "stages": [2, 50]})
    assert [p["s"] for p in data["grid"]["parts"]] == [2]
    assert "50 stages" in data["grid"]["note"]


@given(st.lists(st.integers(0, 6), max_size=60))
def test_run_length_round_trips(stages: list[int]) -> None:
    runs = run_length(stages)
    assert decode(runs) == stages
    assert all(a != b for a, b in zip(runs[0:-2:2], runs[2::2], strict=True))  # runs are maximal


# ==================================================================== safety
def test_embedded_json_is_inert_inside_a_script_element() -> None:
    value = {"name": "</script><script>alert(1)</script>", "amp": "a & b", "sep": "\u2028"}
    text = embed_json(value)
    assert not set("<>&") & set(text) and "\u2028" not in text
    assert json.loads(text) == value


def test_a_tree_that_is_not_the_partitions_is_refused() -> None:
    tree = chain_tree()
    other = ModuleTree.from_spec({"name": "", "children": [{"name": "elsewhere"}]})
    with pytest.raises(PartitionError, match="tree the partition was cut from"):
        to_html(partition(tree, 2), tree=other)


# ==================================================================== duck-typed inputs
@dataclass
class Event:
    stage: int
    microbatch: int
    kind: str
    start_s: float
    end_s: float


class Timeline:
    """Shaped like the runtime's: ``to_dict()`` with the step's duration and plain-dict events."""

    def __init__(self, events: list[Event], duration_s: float) -> None:
        self.events, self.duration_s = events, duration_s

    def to_dict(self) -> dict:
        return {"duration_s": self.duration_s, "events": [vars(e) for e in self.events]}


def test_timeline_is_read_from_objects_dicts_and_lists() -> None:
    events = [Event(0, 0, "forward", 10.0, 10.5), Event(1, 0, "forward", 10.5, 11.0),
              Event(1, 0, "backward", 11.0, 12.0)]
    expected = {"kinds": ["forward", "backward"],
                "events": [[0, 0, 0, 0, 0.5], [1, 0, 0, 0.5, 1], [1, 0, 1, 1, 2]], "span": 2, "schedule": ""}
    assert timeline_events(type("T", (), {"events": events})()) == expected  # .events of objects
    assert timeline_events([vars(e) for e in events]) == expected  # a plain list of dicts
    # to_dict() with the step's duration: times stay relative to the step's start
    from_runtime = timeline_events(Timeline(events, duration_s=13.0))
    assert from_runtime["events"][0] == [0, 0, 0, 10, 10.5] and from_runtime["span"] == 13
    assert timeline_events(None) is None
    with pytest.raises(ConfigError, match="no 'end_s'"):
        timeline_events([{"stage": 0, "microbatch": 0, "kind": "forward", "start_s": 0}])
    with pytest.raises(ConfigError, match="ends"):
        timeline_events([Event(0, 0, "forward", 2.0, 1.0)])


class Plan:
    """Shaped like the planner's: nested config and per-stage dicts next to top-level figures."""

    def __init__(self, pp: int, time_s: float) -> None:
        self.pp, self.time_s = pp, time_s

    def to_dict(self) -> dict:
        return {"pp": self.pp, "time_s": self.time_s, "devices": ["a", "b"],
                "stages": [{"memory_bytes": 1e9 * (s + 1), "first_layer": "h.0"} for s in range(self.pp)],
                "config": {"pipeline_parallel_degree": self.pp, "microbatches": 4 * self.pp, "timeout_s": 60}}


class Plans:
    def __init__(self, plans: list[Plan]) -> None:
        self.plans = plans

    def reasons(self) -> list[str]:
        return ["fastest"]


def test_plans_become_typed_columns_without_repeats() -> None:
    table = plan_table(Plans([Plan(2, 1.5), Plan(4, 0.75)]))
    # config.pipeline_parallel_degree repeats pp and config.timeout_s never varies: both left out
    assert [c["key"] for c in table["columns"]] == ["pp", "time_s", "devices", "stages.memory_bytes",
                                                    "config.microbatches"]
    assert [c["fmt"] for c in table["columns"]] == ["number", "seconds", "text", "bytes", "number"]
    assert table["rows"][1] == [4, 0.75, "a, b", [1e9, 2e9, 3e9, 4e9], 16]
    assert table["notes"] == ["fastest"]
    assert plan_table([{"pp": 1}])["rows"] == [[1]]
    assert plan_table(None) is None
    with pytest.raises(ConfigError, match="dict or have to_dict"):
        plan_table([42])


# ==================================================================== entry points
def test_partition_to_html_writes_the_file(tmp_path) -> None:
    part = partition(chain_tree(), 2)
    path = tmp_path / "part.html"
    page = to_html(part, str(path), grid=False)
    assert path.read_text(encoding="utf-8") == page
    assert embedded(page)["base"]["s"] == 2
    frame = page._repr_html_()
    assert frame.startswith("<iframe srcdoc=") and "<script" not in frame  # all escaped into srcdoc


def test_a_partition_draws_itself_as_the_public_api_says(tmp_path) -> None:
    """DESIGN.md's contract: ``part.show()``, ``part.to_html(path)``, and a notebook shows ``part``."""
    from rich.console import Console

    part = partition(chain_tree(), 2)
    console = Console(record=True, width=120)
    part.show(console)
    assert "stage 1" in console.export_text().lower()
    path = tmp_path / "part.html"
    page = part.to_html(str(path), grid=False)
    assert path.read_text(encoding="utf-8") == page == to_html(part, grid=False)
    assert part._repr_html_().startswith("<iframe srcdoc=")


def test_cli_html_flag_writes_the_explorer(tmp_path, capsys) -> None:
    out = tmp_path / "gpt2.html"
    assert main(["partition", "examples.models:gpt2", "--stages", "2", "--html", str(out)]) == 0
    data = embedded(out.read_text(encoding="utf-8"))
    assert data["base"]["s"] == 2 and "transformer.h.7.mlp" in data["tree"]["name"]
    assert "explorer written to" in capsys.readouterr().out
    saved = tmp_path / "part.json"
    partition(chain_tree(), 3).to_json(str(saved))
    shown = tmp_path / "shown.html"
    assert main(["show", str(saved), "--html", str(shown)]) == 0
    assert embedded(shown.read_text(encoding="utf-8"))["base"]["s"] == 3


def test_cli_plan_html_shows_the_best_plans_partition_on_its_devices(tmp_path) -> None:
    out = tmp_path / "plan.html"
    argv = ["plan", "examples.models:gpt2", "--cluster", "examples/cluster.toml", "--global-batch", "32",
            "--html", str(out)]
    assert main(argv) == 0
    data = embedded(out.read_text(encoding="utf-8"))
    assert data["title"] == "examples.models:gpt2"
    devices = data["base"]["devices"]
    assert len(devices["memory"]) == len(devices["names"]) == data["base"]["s"]
    assert set(devices["names"]) <= {"V100", "T4"} or all("×" in n for n in devices["names"])
    assert data["plans"]["rows"] and data["plans"]["notes"]


def test_a_partition_cut_for_devices_carries_their_speed_and_keeps_them_on_the_grid() -> None:
    tree = chain_tree(12)
    devices = ["T4", "H100", "T4"]
    part = partition(tree, 3, memory_weight=0.0, devices=devices)
    data = explorer_data(part, grid={"memory_weights": [0.0, 1.0], "stages": [2, 3]})
    assert data["base"]["devices"]["tflops"] == [65.0, 989.0, 65.0]
    assert data["base"]["devices"]["names"] == devices
    order = [node.name for node in tree.nodes()]
    for point in data["grid"]["parts"]:
        on = devices if point["s"] == 3 else None  # the devices hold at their own stage count
        expected = partition(tree, point["s"], memory_weight=point["w"], devices=on)
        assert decode(point["runs"]) == [expected.node_stage[n] for n in order], (point["w"], point["s"])
