"""The two random streams of tensor parallelism (`smpart.tensor_parallel.streams`), in one process.

The multi-process check (masks of heads on two ranks, masks of whole activations) is
`tests/test_processes_3d.py::test_dropout_inside_a_split_region_draws_per_rank_and_outside_it_alike`;
here each rule of the streams is checked against plain draws of torch's generator.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from smpart.tensor_parallel import streams

CPU = torch.device("cpu")


def _region_draws(tp_rank: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """What a split region on ``tp_rank`` draws, and what the shared stream draws after it."""
    torch.manual_seed(seed)
    streams.enter(CPU, tp_rank)
    inside = torch.rand(64)
    streams.leave()
    return inside, torch.rand(64)


def test_each_rank_draws_its_own_numbers_inside_a_region_and_the_shared_ones_after_it():
    inside = [_region_draws(rank) for rank in range(4)]
    for rank in range(1, 4):
        assert not torch.equal(inside[0][0], inside[rank][0])  # each rank's own stream
        assert torch.equal(inside[0][1], inside[rank][1])  # the shared stream, alike on every rank
    torch.manual_seed(0)
    torch.randint(0, 2**62, (1,))  # the one number the entry took from the shared stream
    assert torch.equal(torch.rand(64), inside[0][1])  # the region's own draws left it untouched
    assert torch.equal(_region_draws(2)[0], inside[2][0])  # and a rank's stream is reproducible


def test_regions_one_after_another_draw_anew():
    torch.manual_seed(0)
    masks = []
    for _ in range(2):  # two attention layers, nothing drawn on the shared stream between them
        streams.enter(CPU, 1)
        masks.append(torch.rand(64))
        streams.leave()
    assert not torch.equal(masks[0], masks[1])


def test_entering_again_inside_a_region_is_the_same_region():
    torch.manual_seed(0)
    streams.enter(CPU, 1)  # q
    first = torch.rand(8)
    streams.enter(CPU, 1)  # k, v: the same region goes on
    second = torch.rand(8)
    streams.leave()
    torch.manual_seed(0)
    streams.enter(CPU, 1)
    assert torch.equal(torch.rand(16), torch.cat([first, second]))
    streams.leave()


def test_leaving_outside_a_region_changes_nothing():
    torch.manual_seed(0)
    streams.leave()
    streams.leave()
    torch.manual_seed(0)
    expected = torch.rand(8)
    torch.manual_seed(0)
    streams.leave()
    assert torch.equal(torch.rand(8), expected)


def test_a_suspended_region_lets_other_work_draw_from_the_shared_stream_and_goes_on_after():
    torch.manual_seed(0)
    streams.enter(CPU, 1)
    before = torch.rand(8)
    kept = streams.suspend()
    other = torch.rand(8)  # another micro-batch's work on this stage, meanwhile
    streams.resume(kept)
    after = torch.rand(8)
    streams.leave()
    shared_after = torch.rand(8)

    torch.manual_seed(0)
    streams.enter(CPU, 1)
    assert torch.equal(torch.rand(16), torch.cat([before, after]))  # the region's stream, uninterrupted
    streams.leave()
    assert torch.equal(torch.rand(16), torch.cat([other, shared_after]))  # the shared one, too


def test_a_region_overwritten_by_someone_else_is_not_restored_twice():
    """``fork_rng`` (an activation checkpoint's recomputation) puts back a state of its own: the
    region is over, and leaving it must not put back the entry's state on top."""
    torch.manual_seed(0)
    with torch.random.fork_rng(devices=[]):
        streams.enter(CPU, 1)
        torch.rand(8)
    outside = torch.get_rng_state()
    streams.leave()
    assert torch.equal(torch.get_rng_state(), outside)


def test_a_checkpointed_region_recomputes_the_masks_of_its_forward():
    """The rank's stream is made from the shared state at the entry, which a checkpoint restores
    for its recomputation: the backward sees the forward's masks, so the gradient is exact."""
    def split_region(x):
        streams.enter(CPU, 1)
        y = torch.nn.functional.dropout(x, 0.5, training=True)
        streams.leave()
        return torch.nn.functional.dropout(y, 0.5, training=True)  # whole again: shared stream

    x = torch.randn(256, requires_grad=True)
    torch.manual_seed(0)
    checkpoint(split_region, x, use_reentrant=False).sum().backward()
    torch.manual_seed(0)
    plain = x.detach().clone().requires_grad_()
    split_region(plain).sum().backward()
    assert torch.equal(x.grad, plain.grad)
