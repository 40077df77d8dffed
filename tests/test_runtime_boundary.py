"""The stage boundary on its own: what arrives, and the gradients it posts back, against autograd on
the original tensors."""

from __future__ import annotations

import torch

from smpart.runtime import boundary


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
