"""The stage boundary on its own: what arrives, and the gradients it posts back, against autograd on
the original tensors."""

from __future__ import annotations

import pickle
import threading

import pytest
import torch
from torch import nn

from smpart.errors import SmpartError
from smpart.runtime.reference import boundary


def arrive_and_collect(value, call_id=7):
    posted = []
    arrived = boundary.arrive(value, None, boundary.route_back("sender", call_id, True, {}),
                              lambda target, grads: posted.append((target, grads)))
    return arrived, posted


def test_gradients_posted_back_equal_autograd_on_the_sent_tensors():
    a = torch.randn(3, requires_grad=True)
    b = torch.randn(3, requires_grad=True)
    mask = torch.tensor([1.0, 0.0, 1.0])
    value = {"pair": (a * 2, b + 1), "mask": mask}
    sent_left, sent_right = (t.detach().clone().requires_grad_() for t in value["pair"])
    expected = torch.autograd.grad((sent_left * 3 * sent_right * mask).sum(), [sent_left, sent_right])
    arrived, posted = arrive_and_collect(value)
    assert arrived["mask"].requires_grad is False
    left, right = arrived["pair"]
    left.mul_(3)  # an arrived tensor is an ordinary non-leaf: in-place works (the sender's tensor
    # shares its storage and version counter, so the sender's backward would notice, as unsplit)
    (left * right * arrived["mask"]).sum().backward()

    (target, grads), = posted  # one message for the whole value
    assert target == ("sender", 7, True)
    assert sorted(grads) == [0, 1]  # tensors numbered in flatten order; the mask gets none
    torch.testing.assert_close(grads[0], expected[0])
    torch.testing.assert_close(grads[1], expected[1])


def test_one_tensor_and_a_tuple_of_tensors_arrive_as_they_were_sent():
    x = torch.randn(2, 3, requires_grad=True)
    one, posted = arrive_and_collect(x)
    assert isinstance(one, torch.Tensor) and one.requires_grad and not one.is_leaf
    assert one.data_ptr() == x.data_ptr()  # no copy on the same device
    one.sum().backward()
    assert posted[0][1][0].equal(torch.ones(2, 3))

    pair, _ = arrive_and_collect((x, x.detach()))
    assert type(pair) is tuple and [t.requires_grad for t in pair] == [True, False]


def test_without_keyword_arguments_a_call_numbers_its_tensors_as_with_them():
    x, y = torch.randn(2, requires_grad=True), torch.randn(2, requires_grad=True)
    assert boundary.depart_call((x, y), {}, True, str).kept == boundary.depart(((x, y), {}), True, str).kept
    args, kwargs = boundary.arrive_call((x, y), {}, None, boundary.route_back("s", 1, False, {}),
                                        lambda *_: None)
    assert kwargs == {} and [t.requires_grad for t in args] == [True, True]


# ==================================================================== carried state
def _cache(layers: int = 2, requires_grad: bool = False):
    """A Hugging Face DynamicCache holding ``layers`` layers of keys and values."""
    cache_utils = pytest.importorskip("transformers.cache_utils")
    cache = cache_utils.DynamicCache()
    for i in range(layers):
        keys = torch.randn(1, 2, 3, 4, requires_grad=requires_grad) * 1
        cache.update(keys, keys + 1, i)
    return cache


class Opaque:
    """A user's object that is neither a pytree container nor registered as carried state."""

    def __init__(self, tensor):
        self.tensor = tensor


def test_a_cache_crosses_by_reference_without_autograd():
    cache = _cache(requires_grad=True)
    x = torch.randn(2, requires_grad=True)
    departure = boundary.depart_call((x,), {"past_key_values": cache}, True, lambda: "the arguments")
    assert departure.kept == [x]  # the cache's tensors are not numbered: no gradient comes back for them
    (arrived,), kwargs = boundary.arrive_call((x,), {"past_key_values": cache}, None,
                                              boundary.route_back("s", 1, False, {}), lambda *_: None)
    assert kwargs["past_key_values"] is cache and arrived.requires_grad
    assert boundary.is_carried_state(cache) and boundary.carried_leaves(((x,), kwargs)) == [cache]


def test_an_unregistered_object_holding_a_tensor_that_requires_grad_is_refused():
    held = Opaque(torch.randn(2, requires_grad=True) * 2)
    with pytest.raises(SmpartError, match=r"test_runtime_boundary\.Opaque.*register_pytree_node.*"
                                          r"register_carried_state\(Opaque\)"):
        boundary.depart((held,), True, lambda: "the output of module 'm'")
    assert boundary.depart((held,), False, str).kept is None  # no gradient to lose
    constant = Opaque(torch.randn(2))
    assert boundary.depart((constant,), True, str).kept is None and boundary.is_carried_state(constant)


def test_a_registered_type_is_carried_whatever_it_holds():
    @boundary.register_carried_state
    class RollingState(Opaque):
        pass

    held = RollingState(torch.randn(2, requires_grad=True) * 2)
    assert boundary.depart((held,), True, str).kept is None
    assert boundary.is_carried_state(RollingState(None))  # carried even before it holds tensors
    with pytest.raises(SmpartError, match="neither a tensor nor a module"):
        boundary.register_carried_state(nn.Linear)


def test_pack_pickles_the_state_with_its_tensors_detached_and_shared_once():
    cache = _cache(requires_grad=True)
    cache.layers[1].values = cache.layers[0].keys  # one tensor in two places
    snapshot = pickle.loads(pickle.dumps(boundary.pack_state(cache)))
    assert len(snapshot.tensors) == 3 and not any(t.requires_grad for t in snapshot.tensors)
    copy = boundary.unpack_state(snapshot, "cpu")
    assert type(copy) is type(cache) and copy is not cache
    assert copy.layers[1].values is copy.layers[0].keys
    assert torch.equal(copy.layers[1].keys, cache.layers[1].keys) and not copy.layers[1].keys.requires_grad


def test_copy_in_copy_out_across_stages_ends_as_by_reference():
    """Two "processes" update the cache in turn; merging each answer back leaves the caller's object
    (and its layers) as if both had updated it in place."""
    shared, caller = _cache(1), _cache(0)
    caller.update(shared.layers[0].keys, shared.layers[0].values, 0)
    layers_before, first_layer = caller.layers, caller.layers[0]
    for layer in (1, 2):
        new = torch.full((1, 2, 3, 4), float(layer))
        shared.update(new, new, layer)  # by reference, as on threads

        message = boundary.pack_carried(((), {"past_key_values": caller}))  # copy in
        arrived = boundary.arrive(message, None, None, lambda *_: None)  # tensors travel as message tensors
        callee_args, callee_kwargs = boundary.unpack_carried(arrived, "cpu")
        callee_kwargs["past_key_values"].update(new, new, layer)
        answer = [boundary.pack_state(s) for s in boundary.carried_leaves((callee_args, callee_kwargs))]
        for original, snapshot in zip(boundary.carried_leaves(((), {"past_key_values": caller})), answer,
                                      strict=True):
            assert boundary.merge_state(original, boundary.unpack_state(snapshot, "cpu")) is original
    assert caller.layers is layers_before and caller.layers[0] is first_layer
    assert len(caller.layers) == 3
    for mine, theirs in zip(caller.layers, shared.layers, strict=True):
        assert torch.equal(mine.keys, theirs.keys) and torch.equal(mine.values, theirs.values)


def test_state_that_cannot_be_copied_to_a_process_says_why():
    with pytest.raises(SmpartError, match="refers to a module"):
        boundary.pack_state(Opaque(nn.Linear(2, 2)))
    held = Opaque(torch.ones(1))
    held.lock = threading.Lock()
    with pytest.raises(SmpartError, match=r"Opaque to another pipeline stage's process: TypeError"):
        boundary.pack_state(held)
    with pytest.raises(SmpartError, match="not a copy"):
        boundary.merge_state(held, Opaque(None).__dict__)
