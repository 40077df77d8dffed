"""The partition explorer: one self-contained, offline HTML page about a `Partition`.

The page answers "which module went to which stage, and why is stage 3 slow or out of memory?"
for models of a thousand modules: a collapsible module tree with search, an icicle picture of the
whole model coloured by stage, per-stage compute and memory bars, and — when given — a step's
pipeline timeline and the planner's plans.

The trick that keeps it interactive without Python: partitions for a whole grid of
``memory_weight`` × stage counts are computed here, up front, and embedded. A partition is just
"the stage of every node in tree order", which run-length encodes to a few dozen numbers (a
pipeline split is a handful of contiguous runs), so 88 partitions of GPT-3 175B cost kilobytes.
Every other figure (per-stage loads, imbalance) the page derives itself from the node costs.

Safety: module names come from user code. They travel only inside a
``<script type="application/json">`` block with ``<``, ``>`` and ``&`` escaped as ``\\u003c``
etc., and the page writes them with ``textContent`` or onto a canvas, never as markup.

Inputs besides the `Partition` are duck-typed, so the page depends on no class of the runtime or
the planner:

- ``timeline``: an object with ``to_dict()`` (returning ``{"events": [...]}`` or a list) or an
  ``events`` attribute, or a plain list; each event a dict or object with ``stage``,
  ``microbatch``, ``kind`` ("forward" / "backward" / anything else) and ``start_s``, ``end_s``.
- ``plans``: an iterable (or an object with a ``plans`` attribute or a ``to_dict()`` returning
  ``{"plans": [...]}``) of dicts or objects with ``to_dict()``; scalar values become columns
  (nested dicts are flattened one level, lists of numbers show their maximum).
- ``grid``: None for the default (weights 0.0…1.0 by 0.1 × stages 1…8), False or an empty list for
  none, ``{"memory_weights": [...], "stages": [...]}``, an iterable of ``(memory_weight,
  num_stages)`` pairs, or of ready `Partition` objects.
- Devices: ``partition.meta["device_memory"]`` (bytes per stage) and optionally
  ``partition.meta["device_names"]``, as a partition made from a plan carries them; and
  ``partition.meta["device_tflops"]`` (per stage), as ``partition(..., devices=...)`` records it:
  the page then draws each stage's time (its weighted cost ÷ its device's speed) against the
  perfectly balanced time, and the grid's partitions of that stage count are cut for the same
  devices (``partition.meta["devices"]``), so the slider keeps the user's devices.
- Tensor parallelism: ``partition.meta["tensor_parallel"]`` (``{"degree", "split": {node: style}}``,
  as a plan's or the runtime's partition carries it) becomes ``base["tp"]``: the degree, each
  split node's style by node index, and a sentence per style saying what it means. Without that
  meta there is none, even when the tree records what each degree *would* split.
"""

from __future__ import annotations

import html
import json
import math
import re
from collections.abc import Iterable, Mapping
from importlib import resources
from typing import Any

from smpart.errors import ConfigError, PartitionError, SmpartError
from smpart.partitioning.api import partition as cut
from smpart.partitioning.result import Partition
from smpart.tracing.tree import ModuleTree
from smpart.viz.split import describe, tensor_split

DEFAULT_WEIGHTS = tuple(round(0.1 * i, 1) for i in range(11))
DEFAULT_STAGES = tuple(range(1, 9))
#: Plans shown in the table (the planner ranks them; the rest is noise), and columns at most.
MAX_PLANS = 50
MAX_PLAN_COLUMNS = 14

_JSON_ESCAPES = {"<": "\\u003c", ">": "\\u003e", "&": "\\u0026", "\u2028": "\\u2028", "\u2029": "\\u2029"}
_PLACEHOLDER = re.compile(r"\{\{(TITLE|CSS|JS|DATA)\}\}")


# ==================================================================== public entry points
class Page(str):
    """The explorer page's HTML text; a notebook that shows one shows the explorer inline."""

    def _repr_html_(self) -> str:
        return notebook_frame(self)


def to_html(
    partition: Partition,
    path: str | None = None,
    *,
    tree: ModuleTree | None = None,
    timeline: Any = None,
    plans: Any = None,
    grid: Any = None,
    title: str | None = None,
) -> Page:
    """The explorer page for ``partition`` as one HTML string; also written to ``path`` when given.

    ``timeline`` (a step's), ``plans`` (the planner's) and ``grid`` (which partitions to precompute
    for the memory-weight slider) are optional: see the module docstring. In Jupyter the page
    shows inline: ``smpart.to_html(part)`` as a cell's last line.
    """
    if not isinstance(partition, Partition):
        raise ConfigError(f"to_html() draws a Partition (smpart.partition's), got {type(partition).__name__}")
    data = explorer_data(partition, tree=tree, timeline=timeline, plans=plans, grid=grid, title=title)
    page = Page(render_page(data))
    if path is not None:
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(page)
    return page


def notebook_frame(page: str, *, height_px: int = 760) -> str:
    """The explorer inside an ``<iframe srcdoc>``: notebooks sanitise or skip inline scripts in
    plain HTML output, but a srcdoc frame is its own document, so the page's script runs."""
    return (
        f'<iframe srcdoc="{html.escape(page, quote=True)}" '
        f'style="width:100%;height:{height_px}px;border:1px solid #e2e8f0;border-radius:8px" '
        f'title="smpart partition explorer"></iframe>'
    )


def render_page(data: dict[str, Any]) -> str:
    """Fill the template with the stylesheet, the script and the embedded data."""
    assets = resources.files("smpart.viz") / "assets"
    template = (assets / "template.html").read_text(encoding="utf-8")
    script = (assets / "explorer.js").read_text(encoding="utf-8")
    values = {
        "TITLE": html.escape(str(data["title"])),
        "CSS": (assets / "explorer.css").read_text(encoding="utf-8"),
        "JS": script,
        "DATA": embed_json(data),
    }
    # One pass, so a placeholder-looking module name inside the data is never substituted again.
    return _PLACEHOLDER.sub(lambda m: values[m.group(1)], template)


def embed_json(data: Any) -> str:
    """Compact JSON that is safe inside a ``<script>`` element (no ``</script>`` can appear)."""
    text = json.dumps(data, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    return text.translate(str.maketrans(_JSON_ESCAPES))


# ==================================================================== the embedded data
def explorer_data(
    partition: Partition,
    *,
    tree: ModuleTree | None = None,
    timeline: Any = None,
    plans: Any = None,
    grid: Any = None,
    title: str | None = None,
) -> dict[str, Any]:
    """Everything the page shows, as plain JSON-able data (see the module docstring)."""
    tree = _checked_tree(partition, tree)
    order = [node.name for node in tree.nodes()]
    base = _encode_partition(partition, order)
    base["label"] = partition.meta.get("label", "your partition")
    base["devices"] = _devices(partition)
    base["tp"] = _tensor_parallel(partition, order)
    return {
        "v": 1,
        "title": str(title or partition.meta.get("model") or tree.root.class_name),
        "unit": tree.compute_unit,
        "tree": encode_tree(tree),
        "base": base,
        "grid": _grid(tree, order, grid, pins=partition.meta.get("pins") or {},
                      devices=partition.meta.get("devices")),
        "timeline": timeline_events(timeline),
        "plans": plan_table(plans),
    }


def encode_tree(tree: ModuleTree) -> dict[str, Any]:
    """Column arrays over the nodes in tree (pre-)order; a node's parent always comes before it."""
    classes: dict[str, int] = {}
    index: dict[str, int] = {}
    cols: dict[str, list[Any]] = {k: [] for k in ("name", "cls", "parent", "params", "compute", "pmem",
                                                  "bmem", "amem", "calls")}
    aliases: dict[str, list[str]] = {}
    parent_of = {id(c): p for p in tree.nodes() for c in p.children}
    for i, node in enumerate(tree.nodes()):
        index[node.name] = i
        parent = parent_of.get(id(node))
        cols["name"].append(node.name)
        cols["cls"].append(classes.setdefault(node.class_name, len(classes)))
        cols["parent"].append(-1 if parent is None else index[parent.name])
        cols["params"].append(node.param_count)
        cols["compute"].append(_short(tree.compute_of(node)))
        cols["pmem"].append(_short(node.param_bytes * tree.param_memory_factor))
        cols["bmem"].append(node.buffer_bytes)
        cols["amem"].append(node.activation_bytes)
        cols["calls"].append(node.call_count)
        extra = [n for n in node.names if n != node.name]
        if extra:
            aliases[str(i)] = extra
    return {"classes": list(classes), **cols, "aliases": aliases}


def run_length(stages: list[int]) -> list[int]:
    """``[stage, count, stage, count, ...]``: a pipeline split is a few contiguous runs."""
    runs: list[int] = []
    for stage in stages:
        if runs and runs[-2] == stage:
            runs[-1] += 1
        else:
            runs += [stage, 1]
    return runs


def _encode_partition(partition: Partition, order: list[str]) -> dict[str, Any]:
    return {
        "w": round(float(partition.memory_weight), 6),
        "s": partition.num_stages,
        "runs": run_length([partition.node_stage[name] for name in order]),
        "cut": partition.cut_bytes(),
    }


def _checked_tree(partition: Partition, tree: ModuleTree | None) -> ModuleTree:
    if tree is None or tree is partition.tree:
        return partition.tree
    missing = [n.name for n in tree.nodes() if n.name not in partition.node_stage]
    if missing:
        raise PartitionError(
            f"the tree given to to_html has {len(missing)} node(s) the partition does not place "
            f"(e.g. {missing[:3]}); pass the tree the partition was cut from, or none"
        )
    return tree


def _devices(partition: Partition) -> dict[str, Any] | None:
    memory = partition.meta.get("device_memory")
    if not memory:
        return None
    names = partition.meta.get("device_names") or [f"device {i}" for i in range(len(memory))]
    out: dict[str, Any] = {"memory": [float(m) for m in memory], "names": [str(n) for n in names]}
    tflops = partition.meta.get("device_tflops")
    if tflops and len(tflops) == len(memory):
        out["tflops"] = [float(t) for t in tflops]
    return out


def _tensor_parallel(partition: Partition, order: list[str]) -> dict[str, Any] | None:
    """``{"degree", "split": {node index: style}, "explain": {style: sentence}, "summary"}`` or None."""
    split = tensor_split(partition)
    if split is None:
        return None
    index = {name: i for i, name in enumerate(order)}
    styles = {str(index[name]): style for name, style in split.styles.items() if name in index}
    return {
        "degree": split.degree,
        "split": styles,
        "explain": {style: describe(style, split.degree) for style in sorted(set(styles.values()))},
        "summary": split.summary(),
    }


# ==================================================================== the precomputed grid
def _grid(tree: ModuleTree, order: list[str], grid: Any, *, pins: Mapping[str, int],
          devices: list[Any] | None = None) -> dict[str, Any]:
    """Partitions for every grid point, run-length encoded; ``note`` says why one is missing.

    The user's pins (``partition.meta["pins"]``) are kept at every grid point whose stage count
    has room for them, and the user's devices at every grid point of their stage count, so the
    slider moves *their* partition, not a different problem's.
    """
    parts: list[dict[str, Any]] = []
    if grid is False:
        return {"weights": [], "stages": [], "parts": parts, "note": "no grid requested"}
    points = _grid_points(grid)
    ready = [p for p in points if not isinstance(p, tuple)]
    if ready:
        parts = [_encode_partition(p, order) for p in ready]
        return {**_axes(parts), "parts": parts, "note": None}
    skipped = []
    for weight, stages in points:
        if stages == 1:  # nothing to decide: spare the partitioner the call
            stage_list = [0] * len(order)
            parts.append({"w": weight, "s": 1, "runs": run_length(stage_list), "cut": 0})
            continue
        try:
            fitting = {module: s for module, s in pins.items() if s < stages}
            on = devices if devices and len(devices) == stages else None
            cut_here = cut(tree, stages, memory_weight=weight, pin=fitting, devices=on)
            parts.append(_encode_partition(cut_here, order))
        except PartitionError as err:
            skipped.append(f"{stages} stages at w={weight}: {err}")
    axes = _axes(parts) if parts else {"weights": [], "stages": []}
    note = f"{len(skipped)} grid point(s) could not be cut, e.g. {skipped[0]}" if skipped else None
    return {**axes, "parts": parts, "note": note}


def _grid_points(grid: Any) -> list[Any]:
    """Normalise ``grid`` to a list of ``(weight, stages)`` pairs or of ready partitions."""
    if grid is None:
        grid = {"memory_weights": DEFAULT_WEIGHTS, "stages": DEFAULT_STAGES}
    if isinstance(grid, Mapping):
        try:
            weights, stages = grid["memory_weights"], grid["stages"]
        except KeyError as err:
            raise ConfigError(f"grid dict needs 'memory_weights' and 'stages' lists; missing {err}") from None
        return [(_weight(w), _stages(s)) for s in stages for w in weights]
    if not isinstance(grid, Iterable):
        raise ConfigError(f"grid must be None, False, a dict or (memory_weight, stages) pairs; got {grid!r}")
    points: list[Any] = []
    for item in grid:
        if hasattr(item, "node_stage"):
            points.append(item)
        elif isinstance(item, (tuple, list)) and len(item) == 2:
            points.append((_weight(item[0]), _stages(item[1])))
        else:
            raise ConfigError(f"grid entry {item!r} is not a (memory_weight, stages) pair nor a Partition")
    return points


def _weight(value: Any) -> float:
    weight = float(value)
    if not 0.0 <= weight <= 1.0:
        raise ConfigError(f"grid memory_weight {value!r} is outside 0..1")
    return round(weight, 6)


def _stages(value: Any) -> int:
    stages = int(value)
    if stages < 1:
        raise ConfigError(f"grid stage count {value!r} must be at least 1")
    return stages


def _axes(parts: list[dict[str, Any]]) -> dict[str, list[Any]]:
    return {"weights": sorted({p["w"] for p in parts}), "stages": sorted({p["s"] for p in parts})}


# ==================================================================== timeline and plans
def timeline_events(timeline: Any) -> dict[str, Any] | None:
    """``{"kinds", "events": [[stage, microbatch, kind index, start, end], ...], "span", "schedule"}``.

    Times are seconds from the step's start when the timeline says how long the step took
    (``duration_s``, as the runtime's `Timeline` does), else from the first event's start.
    """
    if timeline is None:
        return None
    if hasattr(timeline, "to_dict"):
        timeline = timeline.to_dict()
    elif hasattr(timeline, "events"):
        timeline = timeline.events
    duration, schedule = None, ""
    if isinstance(timeline, Mapping):
        if "events" not in timeline:
            raise ConfigError("a timeline dict needs 'events': [{stage, microbatch, kind, start_s, end_s}]")
        duration, schedule = timeline.get("duration_s"), str(timeline.get("schedule") or "")
        timeline = timeline["events"]
    rows = [_event(i, ev) for i, ev in enumerate(timeline)]
    t0 = 0.0 if duration is not None else min((r[3] for r in rows), default=0.0)
    last = max((r[4] for r in rows), default=0.0) - t0
    kinds: dict[str, int] = {}
    events = [[s, mb, kinds.setdefault(kind, len(kinds)), _short(a - t0), _short(b - t0)]
              for s, mb, kind, a, b in rows]
    span = max(float(duration), last) if duration is not None else last
    return {"kinds": list(kinds), "events": events, "span": _short(span), "schedule": schedule}


def _event(i: int, event: Any) -> tuple[int, int, str, float, float]:
    def get(key: str) -> Any:
        value = event.get(key) if isinstance(event, Mapping) else getattr(event, key, None)
        if value is None:
            raise ConfigError(f"timeline event {i} has no {key!r}; each event needs stage, microbatch, "
                              f"kind, start_s and end_s")
        return value

    start, end = float(get("start_s")), float(get("end_s"))
    if end < start:
        raise ConfigError(f"timeline event {i} ends ({end}) before it starts ({start})")
    return int(get("stage")), int(get("microbatch")), str(get("kind")), start, end


def plan_table(plans: Any) -> dict[str, Any] | None:
    """``{"columns": [{"key", "fmt"}], "rows": [[...]], "notes": [...]}`` for the top plans, in order.

    Top-level scalars of each plan's dict are columns. Nested values (a ``config`` dict, a list
    of per-stage dicts) are flattened to ``outer.inner`` columns, kept only where they tell
    something new: they vary between plans and do not repeat a top-level column.
    """
    if plans is None:
        return None
    notes = _plan_notes(plans)
    if hasattr(plans, "plans"):
        plans = plans.plans
    elif hasattr(plans, "to_dict") and not isinstance(plans, Iterable):
        plans = plans.to_dict()
    if isinstance(plans, Mapping):
        notes = notes or [str(r) for r in plans.get("reasons", [])]
        plans = plans.get("plans", [])
    records = [_plan_record(p) for p in list(plans)[:MAX_PLANS]]
    top_keys: dict[str, None] = {}
    nested_keys: dict[str, None] = {}
    for own, nested in records:
        top_keys.update(dict.fromkeys(own))
        nested_keys.update(dict.fromkeys(nested))
    columns = {k: [own.get(k) for own, _ in records] for k in top_keys}
    for key in nested_keys:
        values = [nested.get(key) for _, nested in records]
        varies = any(v != values[0] for v in values)
        if varies and all(values != other for other in columns.values()):
            columns[key] = values
    keys = list(columns)[:MAX_PLAN_COLUMNS]
    return {
        "columns": [{"key": k, "fmt": _column_format(k, columns[k])} for k in keys],
        "rows": [[columns[k][r] for k in keys] for r in range(len(records))],
        "notes": notes,
    }


def _plan_notes(plans: Any) -> list[str]:
    """The planner's own words on why its best plan wins, when it offers them."""
    reasons = getattr(plans, "reasons", None)
    if not callable(reasons):
        return []
    try:
        return [str(r) for r in reasons()]
    except SmpartError:  # e.g. no plan fits: the table says it already
        return []


def _plan_record(plan: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """A plan's (top-level, nested) displayable values."""
    data = plan.to_dict() if hasattr(plan, "to_dict") else plan
    if not isinstance(data, Mapping):
        raise ConfigError(f"a plan must be a dict or have to_dict(); got {type(plan).__name__}")
    own: dict[str, Any] = {}
    nested: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, Mapping):
            for sub, inner in value.items():
                _put(nested, f"{key}.{sub}", inner)
        elif isinstance(value, (list, tuple)) and value and all(isinstance(v, Mapping) for v in value):
            for sub in value[0]:
                _put(nested, f"{key}.{sub}", [v.get(sub) for v in value], numbers_only=True)
        else:
            _put(own, str(key), value)
    return own, nested


def _put(out: dict[str, Any], key: str, value: Any, *, numbers_only: bool = False) -> None:
    """Keep scalars; a list of numbers stays a list (the page shows its maximum)."""
    if isinstance(value, (list, tuple)) and value and all(_is_number(v) for v in value):
        out[key] = [_short(v) for v in value]
    elif numbers_only:
        return
    elif value is None or isinstance(value, (bool, str)):
        out[key] = value
    elif _is_number(value):
        out[key] = _short(value)
    elif isinstance(value, (list, tuple)) and all(isinstance(v, (str, int, float)) for v in value):
        out[key] = ", ".join(str(v) for v in value)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _column_format(key: str, values: list[Any]) -> str:
    low = key.lower()
    if not any(isinstance(v, (int, float, list)) and not isinstance(v, bool) for v in values):
        return "text"
    if "mem" in low or "byte" in low:
        return "bytes"
    if low.endswith("_s") or "time" in low or "latency" in low:
        return "seconds"
    return "number"


def _short(value: float) -> float | int:
    """Six significant digits: the page draws pixels, not ledgers, and JSON gets much smaller."""
    if isinstance(value, int):
        return value
    if not math.isfinite(value):
        return 0  # JSON has no inf/nan; a cost that is not a number draws as nothing
    if value == int(value) and abs(value) < 1e15:
        return int(value)
    return float(f"{value:.6g}")
