"""`Ambient`: the caller's thread-local state (grad mode, inference mode, autocast) captured on one
thread and applied on another, as a cross-stage call does."""

from __future__ import annotations

import pickle
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from smpart.runtime.ambient import DEFAULT, NO_GRAD, Ambient, capture


def on_another_thread(fn: Callable[[], Any]) -> Any:
    """``fn()`` run on a fresh thread (a stage's), its result or its exception brought back."""
    result: dict[str, Any] = {}

    def run():
        try:
            result["value"] = fn()
        except BaseException as err:  # noqa: BLE001 - re-raised on the calling thread
            result["error"] = err

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(10)
    if "error" in result:
        raise result["error"]
    return result["value"]


@pytest.fixture
def linear() -> nn.Linear:
    return nn.Linear(4, 4)


def test_autocast_captured_on_one_thread_applies_on_another(linear):
    x = torch.randn(2, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ambient = capture()
        assert linear(x).dtype == torch.bfloat16
        assert on_another_thread(lambda: linear(x).dtype) == torch.float32  # thread-local: the bug

    def under_it():
        with ambient.applied():
            return linear(x).dtype, torch.is_autocast_enabled("cpu")

    assert on_another_thread(under_it) == (torch.bfloat16, True)
    assert ambient.autocast == (("cpu", torch.bfloat16),)


def test_applied_restores_the_threads_own_state_and_nests(linear):
    x = torch.randn(2, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bf16 = capture()
    # without its cache: torch's cache is keyed by tensor, not dtype, so under an enclosing
    # bfloat16 autocast it would hand the float16 region the weight already cast to bfloat16
    with torch.autocast("cpu", dtype=torch.float16, cache_enabled=False), torch.no_grad():
        fp16 = capture()
    assert fp16 == Ambient(grad_enabled=False, autocast=(("cpu", torch.float16),), autocast_cache=False)

    def nested():
        seen = []
        with bf16.applied():
            seen.append(linear(x).dtype)
            with fp16.applied():
                seen.append((linear(x).dtype, torch.is_grad_enabled()))
                with DEFAULT.applied():  # the caller had nothing set: autocast is off again
                    seen.append(linear(x).dtype)
                seen.append(linear(x).dtype)
            seen.append((linear(x).dtype, torch.is_grad_enabled()))
        seen.append(capture())
        return seen

    assert on_another_thread(nested) == [
        torch.bfloat16, (torch.float16, False), torch.float32, torch.float16, (torch.bfloat16, True), DEFAULT,
    ]


def test_grad_and_inference_mode_cross_threads(linear):
    x = torch.randn(2, 4)
    with torch.no_grad():
        no_grad = capture()
    with torch.inference_mode():
        inference = capture()
    assert no_grad is NO_GRAD and inference.inference_mode and not inference.grad_enabled

    def run(ambient):
        with ambient.applied():
            out = linear(x)
        return out.requires_grad, out.is_inference()

    assert on_another_thread(lambda: run(no_grad)) == (False, False)
    assert on_another_thread(lambda: run(inference)) == (False, True)
    assert on_another_thread(lambda: run(DEFAULT)) == (True, False)


def test_the_autocast_cache_flag_is_carried():
    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
        ambient = capture()
    assert ambient.autocast_cache is False

    def read():
        with ambient.applied():
            inside = torch.is_autocast_cache_enabled()
        return inside, torch.is_autocast_cache_enabled()

    assert on_another_thread(read) == (False, True)


def test_nothing_set_is_one_shared_instance_and_pickles():
    assert capture() is DEFAULT and capture() is capture()
    with torch.no_grad():
        assert capture() is NO_GRAD
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ambient = capture()
    for each in (DEFAULT, NO_GRAD, ambient):
        assert pickle.loads(pickle.dumps(each)) == each
    with DEFAULT.applied():  # already the thread's state: nothing entered
        assert capture() is DEFAULT
