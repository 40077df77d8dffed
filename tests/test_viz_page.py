"""The partition explorer in a real headless Chromium (Debian's ``chromium``, driven by Playwright).

These tests click, type and drag like a user and read the answers back from the DOM; the
expected values come from the Python side (the `ModuleTree`, the partitioner's own answers).
They never skip in CI: without a browser they fail, unless ``SMPART_SKIP_BROWSER=1`` is set.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from examples.models import gpt2
from smpart.partitioning.api import partition
from smpart.partitioning.result import Partition
from smpart.tracing.tracer import trace
from smpart.tracing.tree import ModuleTree
from smpart.viz import to_html

BROWSER_ARGS = [
    "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]
HOSTILE = "<script>alert(1)</script>"
STAGES, MICROBATCHES = 3, 4


# ==================================================================== fixtures
@pytest.fixture(scope="module")
def browser() -> Iterator:
    if os.environ.get("SMPART_SKIP_BROWSER") == "1":
        pytest.skip("SMPART_SKIP_BROWSER=1")
    executable = shutil.which("chromium") or shutil.which("chromium-browser")
    if executable is None:
        pytest.fail("the page tests need Chromium: `apt-get install chromium` (or set SMPART_SKIP_BROWSER=1)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=executable, args=BROWSER_ARGS)
        yield chromium
        chromium.close()


@pytest.fixture(scope="module")
def gpt2_tree() -> ModuleTree:
    ex = gpt2()
    return trace(ex.model, ex.args, ex.kwargs, device="meta")


def gpipe_timeline(stages: int, microbatches: int, fwd: float = 0.01, bwd: float = 0.02) -> list[dict]:
    """All forwards, then all backwards, each waiting on its neighbour stage: bubbles included."""
    events, free, done = [], [0.0] * stages, {}
    for m in range(microbatches):
        for s in range(stages):
            start = max(free[s], done.get(("f", s - 1, m), 0.0))
            events.append(dict(stage=s, microbatch=m, kind="forward", start_s=start, end_s=start + fwd))
            free[s] = done["f", s, m] = start + fwd
    for m in range(microbatches):
        for s in reversed(range(stages)):
            start = max(free[s], done.get(("b", s + 1, m), done["f", stages - 1, m]))
            events.append(dict(stage=s, microbatch=m, kind="backward", start_s=start, end_s=start + bwd))
            free[s] = done["b", s, m] = start + bwd
    return events


PLANS = [
    {"pp": 4, "tp": 1, "dp": 2, "microbatches": 16, "time_s": 1.7, "memory_per_device": [3e9, 2e9]},
    {"pp": 2, "tp": 2, "dp": 2, "microbatches": 8, "time_s": 1.2, "memory_per_device": [5e9, 4e9]},
    {"pp": 8, "tp": 1, "dp": 1, "microbatches": 32, "time_s": 2.5, "memory_per_device": [1e9, 1e9]},
    {"pp": 1, "tp": 8, "dp": 1, "microbatches": 4, "time_s": 0.9, "memory_per_device": [9e9]},
]


@pytest.fixture(scope="module")
def gpt2_page(gpt2_tree: ModuleTree, tmp_path_factory: pytest.TempPathFactory) -> Path:
    part = partition(gpt2_tree, 4, memory_weight=0.8)
    path = tmp_path_factory.mktemp("viz") / "gpt2.html"
    to_html(part, str(path), timeline=gpipe_timeline(STAGES, MICROBATCHES), plans=PLANS)
    return path


@contextmanager
def opened(browser, path: Path, *, on_dialog=None, wait_ready: bool = True) -> Iterator:
    """A page showing ``path``; asserts on exit that nothing was logged as an error."""
    page = browser.new_page(viewport={"width": 1440, "height": 900})
    page.set_default_timeout(10_000)
    errors: list[str] = []
    page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
    page.on("pageerror", lambda err: errors.append(str(err)))
    if on_dialog is not None:
        page.on("dialog", on_dialog)
    try:
        page.goto(path.as_uri())
        if wait_ready:
            page.wait_for_selector("body[data-ready='true']", timeout=15_000)
        yield page
    finally:
        page.close()
    assert errors == []


def row(page, name: str):
    return page.locator(f"#tree .row[data-name={json.dumps(name)}]")


def search(page, query: str) -> None:
    page.fill("#search", query)
    page.press("#search", "Enter")


# ==================================================================== tests
@pytest.mark.timeout(120)
def test_page_loads_without_errors_and_screenshots(browser, gpt2_page: Path, tmp_path: Path) -> None:
    with opened(browser, gpt2_page) as page:
        assert "smpart" in page.title()
        assert page.locator("#tree .row").count() > 1
        assert page.locator("#stage-bars .stage-row").count() == 4
        shot = tmp_path / "explorer.png"
        page.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 10_000


@pytest.mark.timeout(120)
def test_expanding_a_node_shows_its_children(browser, gpt2_page: Path, gpt2_tree: ModuleTree) -> None:
    name = "transformer.h.3.attn"
    expected = [child.name for child in gpt2_tree.node(name).children]
    with opened(browser, gpt2_page) as page:
        search(page, name)  # reveals the row itself, not its children
        caret = row(page, name).locator(".caret")
        if row(page, name).get_attribute("aria-expanded") == "true":
            caret.click()
        assert row(page, name).get_attribute("aria-expanded") == "false"
        assert not any(row(page, child).is_visible() for child in expected)
        caret.click()
        assert row(page, name).get_attribute("aria-expanded") == "true"
        for child in expected:
            assert row(page, child).is_visible(), child
        caret.click()
        assert not any(row(page, child).is_visible() for child in expected)


@pytest.mark.timeout(120)
def test_search_finds_and_reveals_a_module(browser, gpt2_page: Path) -> None:
    target = "transformer.h.7.mlp"
    with opened(browser, gpt2_page) as page:
        page.click("#collapse-all")
        assert not row(page, target).is_visible()
        search(page, target)
        found = row(page, target)
        assert found.is_visible()
        assert "selected" in found.get_attribute("class")
        panel, box = page.locator("#tree").bounding_box(), found.bounding_box()
        assert panel["y"] <= box["y"] and box["y"] + box["height"] <= panel["y"] + panel["height"]
        assert page.locator("#details .full").text_content() == target


@pytest.mark.timeout(120)
def test_memory_weight_slider_moves_a_module(browser, gpt2_page: Path, gpt2_tree: ModuleTree) -> None:
    # The partitioner itself says which module moves between w=0 and w=1 (and where to).
    for stages in (4, 2, 3, 5, 6, 7, 8):
        at_compute = partition(gpt2_tree, stages, memory_weight=0.0).module_stages()
        at_memory = partition(gpt2_tree, stages, memory_weight=1.0).module_stages()
        moved = [m for m in at_compute if m and at_compute[m] != at_memory[m]]
        if moved:
            break
    assert moved, "the memory weight should matter for gpt2"
    module = moved[0]
    with opened(browser, gpt2_page) as page:
        page.click(f"#stage-picker button[data-stages='{stages}']")
        search(page, module)
        page.focus("#weight")
        page.keyboard.press("Home")
        assert row(page, module).get_attribute("data-stage") == str(at_compute[module])
        assert page.locator("#weight-value").text_content() == "0.00"
        page.keyboard.press("End")
        assert row(page, module).get_attribute("data-stage") == str(at_memory[module])
        assert page.locator("#weight-value").text_content() == "1.00"
        assert page.locator("#stage-bars .stage-row").count() == stages


@pytest.mark.timeout(120)
def test_compute_memory_toggle_changes_the_picture(browser, gpt2_page: Path) -> None:
    with opened(browser, gpt2_page) as page:
        picture = "document.getElementById('icicle').toDataURL()"
        by_compute = page.evaluate(picture)
        page.click("#size-by button[data-size='memory']")
        assert "active" in page.get_attribute("#size-by button[data-size='memory']", "class")
        by_memory = page.evaluate(picture)
        assert by_memory != by_compute
        page.click("#size-by button[data-size='compute']")
        assert page.evaluate(picture) == by_compute


@pytest.mark.timeout(120)
def test_clicking_the_map_zooms_and_selects_in_the_tree(browser, gpt2_page: Path) -> None:
    with opened(browser, gpt2_page) as page:
        canvas = page.locator("#icicle")
        box = canvas.bounding_box()
        page.mouse.click(box["x"] + box["width"] * 0.3, box["y"] + box["height"] * 0.45)
        selected = page.locator("#tree .row.selected")
        assert selected.count() == 1
        assert selected.get_attribute("data-name") == page.locator("#details .full").text_content()


@pytest.mark.timeout(120)
def test_timeline_rows_render_with_hover_times(browser, gpt2_page: Path) -> None:
    with opened(browser, gpt2_page) as page:
        assert page.locator("#timeline .tl-row").count() == STAGES
        assert page.locator("#timeline rect.blk").count() == 2 * STAGES * MICROBATCHES
        page.locator("#timeline .tl-row[data-stage='1'] rect.blk[data-kind='backward']").first.hover()
        tip = page.locator("#tooltip")
        assert tip.is_visible()
        assert "stage 1" in tip.text_content() and "backward" in tip.text_content()
        assert "ms" in tip.text_content()


@pytest.mark.timeout(120)
def test_plans_table_sorts_by_a_column(browser, gpt2_page: Path) -> None:
    with opened(browser, gpt2_page) as page:
        header = page.locator("#plans th[data-key='time_s']")
        column = list(PLANS[0]).index("time_s")
        cells = f"#plans tbody tr td:nth-child({column + 1})"
        header.click()
        assert header.get_attribute("aria-sort") == "ascending"
        expected = sorted(PLANS, key=lambda p: p["time_s"])
        pp_cells = page.locator("#plans tbody tr td:nth-child(1)").all_text_contents()
        assert pp_cells == [str(p["pp"]) for p in expected]
        header.click()
        assert header.get_attribute("aria-sort") == "descending"
        assert page.locator(cells).first.text_content() == "2.50 s"


@pytest.mark.timeout(120)
def test_device_capacity_is_drawn_and_overflow_shown(browser, gpt2_tree: ModuleTree, tmp_path: Path) -> None:
    part = partition(gpt2_tree, 2, memory_weight=0.8)
    part.meta["device_memory"] = [1.0, 1e12]  # stage 0 cannot fit in one byte
    part.meta["device_names"] = ["tiny-gpu", "big-gpu"]
    path = tmp_path / "devices.html"
    to_html(part, str(path), grid=False)
    with opened(browser, path) as page:
        assert page.locator("#stage-bars .cap").count() == 2
        assert page.locator("#stage-bars .stage-row[data-stage='0'] .val.over").count() == 1
        assert page.locator("#stage-bars .stage-row[data-stage='1'] .val.over").count() == 0
        assert "tiny-gpu" in page.locator("#stage-bars").text_content()


@pytest.mark.timeout(120)
def test_tensor_parallel_splits_are_badged_and_explained(browser, gpt2_tree: ModuleTree, tmp_path) -> None:
    part = partition(gpt2_tree, 2, memory_weight=0.8)
    split = {"transformer.h.0.mlp.c_fc": "column", "transformer.h.0.mlp.c_proj": "row",
             "transformer.h.0.attn": "heads"}
    part.meta["tensor_parallel"] = {"degree": 2, "split": split}  # as a plan with tp = 2 records it
    path = tmp_path / "tp.html"
    to_html(part, str(path), grid=False)
    with opened(browser, path) as page:
        search(page, "transformer.h.0.mlp.c_fc")
        assert row(page, "transformer.h.0.mlp.c_fc").locator(".tp-tag").text_content() == "tp×2 column"
        assert row(page, "transformer.h.0.attn").locator(".tp-tag").text_content() == "tp×2 heads"
        assert row(page, "transformer.h.0.ln_1").locator(".tp-tag").count() == 0
        assert page.locator("#tree .row .tp-tag").count() == 3
        assert "3 modules split" in page.locator("#legend .tp-legend").text_content()
        row(page, "transformer.h.0.mlp.c_fc").click()
        note = page.locator("#details .tp-note").text_content()
        assert "split 2 ways by columns: each rank holds 1/2 of the weight" in note
        row(page, "transformer.h.0.ln_1").click()
        assert "each of the 2 ranks holds all of it" in page.locator("#details .tp-note").text_content()


@pytest.mark.timeout(120)
def test_hostile_module_names_are_shown_as_text(browser, tmp_path: Path) -> None:
    tree = ModuleTree.from_spec({
        "name": "", "class_name": "Net", "children": [
            {"name": "a", "class_name": "Linear", "flops": 10, "param_bytes": 40},
            {"name": HOSTILE, "class_name": "<img src=x onerror=alert(2)>", "flops": 5, "param_bytes": 400},
            {"name": "b{{DATA}}", "class_name": "</script><script>alert(3)</script>", "flops": 7},
        ],
    })
    path = tmp_path / "hostile.html"
    to_html(Partition(tree, {"": 0, "a": 0, HOSTILE: 1, "b{{DATA}}": 1}, 2, 0.5), str(path), grid=False)
    assert "<script>alert" not in path.read_text(encoding="utf-8")
    dialogs: list[str] = []
    with opened(browser, path, on_dialog=lambda d: (dialogs.append(d.message), d.dismiss())) as page:
        search(page, "alert(1)")
        hostile = row(page, HOSTILE)
        assert hostile.locator(".nm").text_content() == HOSTILE
        assert hostile.locator(".cls").text_content() == "<img src=x onerror=alert(2)>"
        assert row(page, "b{{DATA}}").count() == 1
        assert page.locator("#tree img, #tree script").count() == 0
        page.screenshot(path=str(tmp_path / "hostile.png"))
    assert dialogs == []


@pytest.mark.timeout(120)
@pytest.mark.parametrize("spec", [
    {"name": "", "class_name": "Lonely"},  # one node, no costs at all
    {"name": "", "children": [{"name": "a", "call_count": 0}, {"name": "b", "param_bytes": 8}]},
], ids=["single-node", "no-compute"])
def test_degenerate_trees_still_load(browser, spec: dict, tmp_path: Path) -> None:
    tree = ModuleTree.from_spec(spec)
    path = tmp_path / "tiny.html"
    to_html(Partition(tree, {n.name: 0 for n in tree.nodes()}, 1, 0.5), str(path), grid=False)
    with opened(browser, path) as page:
        page.click("#size-by button[data-size='memory']")
        page.click("#stage-picker button[data-stages='1']")
        assert page.locator("#stage-bars .stage-row").count() == 1


@pytest.mark.timeout(120)
def test_notebook_repr_runs_the_explorer_in_an_iframe(browser, gpt2_tree: ModuleTree, tmp_path: Path) -> None:
    part = partition(gpt2_tree, 2, memory_weight=0.5)
    path = tmp_path / "notebook.html"
    inline = to_html(part)._repr_html_()
    path.write_text(f"<!DOCTYPE html><html><body>{inline}</body></html>", encoding="utf-8")
    with opened(browser, path, wait_ready=False) as page:
        frame = page.frame_locator("iframe")
        frame.locator("body[data-ready='true']").wait_for(timeout=15_000)
        assert frame.locator("#tree .row").count() > 1


@pytest.mark.timeout(120)
def test_stages_on_unequal_devices_show_their_time_and_speed(browser, gpt2_tree, tmp_path) -> None:
    """Cut for two V100s then two A100s: each stage names its device and speed, a time bar (its cost
    ÷ its device's speed) is drawn against a perfect balance, the time figure is the partitioner's
    own imbalance (at memory_weight 0 the page's cost is the partitioner's), and the slider's
    partitions are cut for the same devices."""
    devices = ["V100", "V100", "A100-80", "A100-80"]
    part = partition(gpt2_tree, 4, memory_weight=0.0, devices=devices)
    at_memory = partition(gpt2_tree, 4, memory_weight=1.0, devices=devices).module_stages()
    plain = partition(gpt2_tree, 4, memory_weight=1.0).module_stages()
    moved = [m for m in at_memory if m and at_memory[m] != plain[m]]
    assert moved, "the devices should change where some module goes"
    path = tmp_path / "unequal.html"
    to_html(part, str(path), grid={"memory_weights": [0.0, 1.0], "stages": [2, 4]})
    with opened(browser, path) as page:
        rows = page.locator("#stage-bars .stage-row")
        assert rows.count() == 4
        assert page.locator("#stage-bars .bar.time").count() == 4
        for s, name in enumerate(devices):
            text = rows.nth(s).text_content()
            assert name in text and ("125 TFLOPS" if name == "V100" else "312 TFLOPS") in text, text
        assert page.locator("#time-figure .v").text_content().startswith(f"{part.imbalance:.2f}")
        # the slider's w = 1 partition is the one cut for these devices, not for alike ones
        search(page, moved[0])
        page.focus("#weight")
        page.keyboard.press("End")
        assert row(page, moved[0]).get_attribute("data-stage") == str(at_memory[moved[0]])
        assert page.locator("#stage-bars .bar.time").count() == 4  # still drawn against the devices
        page.click("#stage-picker button[data-stages='2']")  # another stage count: no devices, no times
        assert page.locator("#stage-bars .bar.time").count() == 0
