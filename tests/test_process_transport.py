"""ProcessTransport between real processes: gloo on CPU, started by `tests.launch`'s fork server.

Each test starts a few ranks (`tests.launch.run_ranks`: a free port, a hard deadline), runs one
scenario function on every rank, and gets each rank's findings back; the assertions are made in
the parent. Every process is joined (a process still alive at the end is killed and fails the test).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.distributed as dist

from smpart.errors import SmpartError
from smpart.runtime.wire import frames as wire
from smpart.runtime.wire.processes import PeerLost, ProcessTransport, pair_groups
from tests.launch import run_ranks

SENDERS_TO_ZERO = 80  # messages each of ranks 1 and 2 sends to rank 0 (who echoes every one)
SIDEWAYS = range(0, SENDERS_TO_ZERO, 30)  # of those, the ones also sent between ranks 1 and 2


@dataclass
class Packet:
    src: int
    seq: int
    payload: Any
    note: str = ""
    extra: dict = field(default_factory=dict)


class Grumpy:
    """Pickles fine, refuses to be unpickled: the receiver gets an error, and the next messages."""

    def __init__(self) -> None:
        self.mood = "grumpy"  # some state, or unpickling would not call __setstate__

    def __setstate__(self, state: dict) -> None:
        raise ValueError("Grumpy refuses to be unpickled")


class _Dies(Exception):
    """Raised by a scenario to end its process with an uncaught exception, as a crash would."""


def _in_group(rank: int, scenario, world: int, options: dict) -> Any:
    """Runs in each process: join the group, run the scenario, leave cleanly. A `_Dies` leaves
    uncaught: the process ends with its transport's threads still blocked in gloo."""
    dist.init_process_group("gloo", rank=rank, world_size=world)
    found = scenario(rank, world, **options)
    dist.destroy_process_group()
    return found


def _spawn(
    scenario, world: int, *, reporting: set[int] | None = None, stray: set[int] = frozenset(), **options
) -> tuple[dict[int, Any], dict[int, int | None]]:
    """Run ``scenario`` on ``world`` ranks (`run_ranks`); the ``reporting`` ranks (default: all)
    must report.

    Ranks in ``stray`` (hung on purpose) are killed once the others reported. Returns
    ({rank: findings}, {rank: exit code}). A rank that reports an error fails the test.
    """
    reporting = set(range(world)) if reporting is None else reporting
    results = run_ranks(_in_group, world, scenario, world, options, timeout_s=60.0, stray=stray)
    for result in results:
        if result.rank in reporting and result.error is not None:
            pytest.fail(f"rank {result.rank} failed:\n{result.error}")
    silent = sorted(r.rank for r in results if r.rank in reporting and not r.reported)
    if silent:
        pytest.fail(f"ranks {silent} did not report within 60 s")
    hung = [r.rank for r in results if r.overstayed]
    assert not hung, f"ranks {hung} did not exit"
    return {r.rank: r.value for r in results if r.rank in reporting}, {r.rank: r.exitcode for r in results}


def _payload(src: int, seq: int) -> dict:
    """A nested payload whose dtypes and shapes change with ``seq``, rebuilt identically by a checker."""
    gen = torch.Generator().manual_seed(1000 * src + seq)
    rows = 1 + seq % 4
    shared = torch.randn(rows, 2, generator=gen)
    return {
        "f64": [torch.randn(rows, 3, generator=gen, dtype=torch.float64)],
        "pair": (torch.arange(seq % 5, dtype=torch.int64), torch.rand(rows, generator=gen) > 0.5),
        "bf16": torch.randn(2, seq % 3, generator=gen).to(torch.bfloat16),
        "scalar": torch.tensor(float(seq)),
        "twice": [shared, shared],  # one tensor object, twice: sent once, arrives as one object
        "plain": {"seq": seq, "text": "x" * (seq * 13)},
        # past the inline budget: travels on its own, on the data group
        "big": [torch.randn(wire.INLINE_BUDGET // 4 + 1, generator=gen)] if seq % 20 == 0 else [],
    }


def _payload_bytes(payload: dict) -> int:
    tensors = [*payload["f64"], *payload["pair"], payload["bf16"], payload["scalar"], payload["twice"][0],
               *payload["big"]]
    return sum(t.numel() * t.element_size() for t in tensors)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and not b.requires_grad
            and torch.equal(a, b)
        )
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def _receive(transport: ProcessTransport, rank: int, timeout: float = 30.0) -> Any:
    message = transport.receive(rank, timeout)
    assert message is not None, f"rank {rank}: nothing arrived within {timeout} s"
    return message


# -- the wire format, in one process -------------------------------------------------------------


def _through_the_wire(message: Any, inline_budget: int) -> tuple[Any, wire.Packed]:
    """``message`` packed, its frame and tail copied as gloo would into a reused receive buffer,
    its other tensors received one by one, and rebuilt."""
    packed = wire.pack(message, inline_budget)
    buffer = torch.full((wire.FRAME_BYTES,), 0xEE, dtype=torch.uint8)  # stale bytes past the frame
    buffer[: packed.frame.numel()].copy_(packed.frame)
    incoming = wire.open_frame(buffer, None if packed.tail is None else packed.tail.clone())
    buffer.fill_(0xEE)  # the buffer takes the next message: what came inline must not change
    received = []
    for spec, tensor in zip(incoming.specs, packed.tensors, strict=True):
        data = wire.empty_for(spec)
        data.copy_(wire.to_wire(tensor))
        received.append(wire.from_wire(data, spec))
    return wire.rebuild(incoming, received), packed


@pytest.mark.parametrize("frame_bytes", [wire.FRAME_BYTES, 300])  # 300: headers with a tail
@pytest.mark.parametrize("seq", [0, 1, 5, 70])
def test_wire_round_trip_without_processes(seq: int, frame_bytes: int, monkeypatch: pytest.MonkeyPatch,
                                           ) -> None:
    monkeypatch.setattr(wire, "FRAME_BYTES", frame_bytes)
    payload = _payload(1, seq)
    payload["grad"] = torch.ones(2, requires_grad=True) * 2
    payload["wide"] = torch.arange(3000, dtype=torch.float32).reshape(3, 1000)[:, ::2]  # not contiguous
    complex_ = torch.randn(3, dtype=torch.complex64, generator=torch.Generator().manual_seed(seq))
    payload["conj"], payload["neg"] = complex_.conj(), complex_.conj().imag  # lazy conjugate, negative bits
    payload["fp8"] = torch.linspace(-2, 2, seq % 4).to(torch.float8_e4m3fn)  # numpy has no such dtype
    for budget in (0, wire.INLINE_BUDGET):  # 0: only tensors of at most SMALL_BYTES inline
        packet, packed = _through_the_wire(Packet(1, seq, payload), budget)
        expected = {**_payload(1, seq), "grad": torch.full((2,), 2.0), "wide": payload["wide"].contiguous(),
                    "conj": complex_.conj().resolve_conj(), "neg": complex_.conj().imag.resolve_neg(),
                    "fp8": payload["fp8"]}
        assert _same(expected, packet.payload)
        assert packet.payload["twice"][0] is packet.payload["twice"][1]
        # "wide" on its own with no budget; the payload's "big" (seq 0) past any budget
        assert len(packed.tensors) == (budget == 0) + (seq == 0)
        assert packed.tensor_bytes == _payload_bytes(payload) + 8 + 6000 + 24 + 12 + seq % 4
        whole = packed.frame.numel() + (0 if packed.tail is None else packed.tail.numel())
        assert wire.frame_lengths(packed.frame)[1] == whole  # the frame announces what it sends
        assert (packed.tail is not None) == (whole > frame_bytes)
    assert wire.frame_lengths(wire.goodbye())[0] == wire.GOODBYE


def test_tensors_ride_in_the_frame_up_to_the_budget() -> None:
    shared = torch.tensor(3.5)
    message = {"loss": shared, "again": shared, "grad": torch.ones(2, 3, requires_grad=True) * 2,
               "half": torch.ones(3, dtype=torch.bfloat16), "empty": torch.empty(0, 4),
               "big": torch.ones(1000), "bigger": torch.ones(2000)}
    received, packed = _through_the_wire(message, 4100)
    assert [t.numel() for t in packed.tensors] == [2000]  # "big" fit the budget, "bigger" did not
    assert packed.frame.numel() < 4000 + 4 + 24 + 6 + 600  # the header, then only the bytes used
    assert received["loss"] is received["again"] and received["loss"].item() == 3.5
    assert torch.equal(received["grad"], torch.full((2, 3), 2.0)) and not received["grad"].requires_grad
    assert received["half"].dtype == torch.bfloat16 and received["empty"].shape == (0, 4)
    assert torch.equal(received["big"], torch.ones(1000))
    assert torch.equal(received["bigger"], torch.ones(2000))


def test_wire_refuses_tensors_without_plain_data() -> None:
    for tensor in (torch.eye(2).to_sparse(), torch.empty(2, device="meta")):
        with pytest.raises(SmpartError, match="only dense tensors"):
            wire.pack({"t": tensor})


# -- scenario: exchange -------------------------------------------------------------------------


def _exchange(rank: int, world: int) -> dict:
    before = {t.ident for t in threading.enumerate()}
    # Headers on the default group, tensors on one gloo group per ordered pair (as NCCL would need).
    pairs = pair_groups(range(world), "gloo")
    transport = ProcessTransport(rank, world, dist.group.WORLD, data_groups=pairs)
    found: dict[str, Any] = {}

    # What cannot be sent fails at send, on the caller's thread, as SmpartError.
    found["unpicklable"] = []
    for bad in (Packet(rank, -2, lambda: None), Packet(rank, -3, threading.Lock())):
        started = time.monotonic()
        try:
            transport.send((rank + 1) % world, bad)
            found["unpicklable"].append(("no error", 0.0))
        except SmpartError as err:
            found["unpicklable"].append((str(err), time.monotonic() - started))
    try:
        transport.send((rank + 1) % world, Packet(rank, -4, torch.eye(2).to_sparse()))
        found["sparse"] = "no error"
    except SmpartError as err:
        found["sparse"] = str(err)
    found["misuse"] = []  # rank 3 does not exist
    for misuse in (lambda: transport.send(3, Packet(rank, -6, None)), lambda: transport.receive(3, 0)):
        try:
            misuse()
            found["misuse"].append("no error")
        except SmpartError as err:
            found["misuse"].append(str(err))

    expected_bytes: dict[tuple[int, int], int] = {}
    if rank == 0:  # echo every message back; check each sender's order on the way
        next_seq = {1: 0, 2: 0}
        for _ in range(2 * SENDERS_TO_ZERO):
            packet = _receive(transport, 0)
            assert packet.seq == next_seq[packet.src], (packet.src, packet.seq, next_seq)
            next_seq[packet.src] += 1
            assert _same(_payload(packet.src, packet.seq), packet.payload)
            assert packet.payload["twice"][0] is packet.payload["twice"][1]
            transport.send(packet.src, packet)
            key = (0, packet.src)
            expected_bytes[key] = expected_bytes.get(key, 0) + _payload_bytes(packet.payload)
        found["fifo_from"] = next_seq
        found["messages_expected"] = 2 * SENDERS_TO_ZERO
    else:  # ranks 1 and 2: a stream to rank 0, a few to each other, then the echoes back
        other = 3 - rank
        transport.send(other, Grumpy())
        for seq in range(SENDERS_TO_ZERO):
            payload = _payload(rank, seq)
            transport.send(0, Packet(rank, seq, payload, note="to zero"))
            expected_bytes[(rank, 0)] = expected_bytes.get((rank, 0), 0) + _payload_bytes(payload)
            if seq in SIDEWAYS:
                transport.send(other, Packet(rank, seq, payload, note="sideways"))
                expected_bytes[(rank, other)] = expected_bytes.get((rank, other), 0) + _payload_bytes(payload)
        echoes, sideways, refused = [], [], []
        while len(echoes) < SENDERS_TO_ZERO or len(sideways) < len(SIDEWAYS) or not refused:
            try:
                packet = _receive(transport, rank)
            except PeerLost:
                raise
            except SmpartError as err:
                refused.append(str(err))
                continue
            (echoes if packet.note == "to zero" else sideways).append(packet)
        found["refused"] = refused
        assert [p.seq for p in echoes] == list(range(SENDERS_TO_ZERO))
        assert all(_same(_payload(rank, p.seq), p.payload) for p in echoes)
        assert [(p.src, p.seq) for p in sideways] == [(other, seq) for seq in SIDEWAYS]
        assert all(_same(_payload(other, p.seq), p.payload) for p in sideways)
        found["messages_expected"] = SENDERS_TO_ZERO + len(SIDEWAYS) + 1

    # Own rank: delivered by reference, never pickled (a lambda would not pickle). Nothing else is
    # on its way to this rank any more, so the next message is this one, and then none.
    mine = Packet(rank, -1, torch.ones(3), extra={"fn": lambda: None})
    transport.send(rank, mine)
    found["self_by_reference"] = transport.receive(rank, 0) is mine
    found["empty_poll"] = transport.receive(rank, 0) is None

    transport.close()
    found["bytes_sent"] = dict(transport.bytes_sent)
    found["bytes_expected"] = expected_bytes
    found["messages_sent"] = transport.messages_sent
    found["lost"] = set(transport.lost)
    found["threads_left"] = [t.name for t in threading.enumerate() if t.ident not in before]
    try:
        transport.send((rank + 1) % world, Packet(rank, -5, None))
        found["send_after_close"] = "no error"
    except SmpartError as err:
        found["send_after_close"] = str(err)
    return found


@pytest.mark.timeout(120)
def test_exchange_between_three_processes() -> None:
    found, exits = _spawn(_exchange, 3)
    assert exits == {0: 0, 1: 0, 2: 0}
    assert found[0]["fifo_from"] == {1: SENDERS_TO_ZERO, 2: SENDERS_TO_ZERO}
    for rank in (1, 2):
        [refusal] = found[rank]["refused"]
        assert f"from rank {3 - rank}" in refusal and "Grumpy refuses" in refusal
    for rank, seen in found.items():
        assert seen["self_by_reference"] and seen["empty_poll"]
        for outcome in seen["unpicklable"]:
            message, seconds = outcome
            assert "does not pickle" in message and seconds < 1.0
        assert "sparse" in seen["sparse"]
        assert all("rank 3" in message for message in seen["misuse"]), seen["misuse"]
        assert seen["bytes_sent"] == seen["bytes_expected"], rank
        assert seen["messages_sent"] == seen["messages_expected"], rank
        assert seen["lost"] == set()
        assert seen["threads_left"] == [], rank
        assert "closed" in seen["send_after_close"]


# -- scenario: a peer dies ------------------------------------------------------------------------


def _hello(transport: ProcessTransport, rank: int, world: int) -> None:
    """Everyone sends to everyone and waits for everyone: all transports are up."""
    for peer in range(world):
        if peer != rank:
            transport.send(peer, Packet(rank, 0, torch.zeros(2)))
    for _ in range(world - 1):
        _receive(transport, rank)


def _wait_until_sent(transport: ProcessTransport, count: int) -> None:
    """Block until ``count`` messages left this rank (sending is asynchronous)."""
    deadline = time.monotonic() + 30.0
    while transport.messages_sent < count and time.monotonic() < deadline:
        time.sleep(0.01)
    assert transport.messages_sent >= count


def _await_loss(transport: ProcessTransport, rank: int, limit_s: float) -> tuple[float, PeerLost | None]:
    started = time.monotonic()
    while time.monotonic() - started < limit_s:
        try:
            transport.receive(rank, 0.2)
        except PeerLost as err:
            return time.monotonic() - started, err
    return time.monotonic() - started, None


def _victim(rank: int, world: int, *, victim: int, how: str) -> dict:
    transport = ProcessTransport(rank, world, dist.group.WORLD, heartbeat_s=0.5, lost_after_s=5.0)
    _hello(transport, rank, world)
    if rank == victim:
        _wait_until_sent(transport, world - 1)
        if how == "exit":
            os._exit(3)
        if how == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise _Dies("an uncaught exception ends this rank")  # how == "raise"
    seconds, err = _await_loss(transport, rank, 30.0)
    found: dict[str, Any] = {"seconds": seconds, "error": None if err is None else (err.rank, str(err))}
    try:
        transport.receive(rank, 0)
        found["raises_again"] = False
    except PeerLost:
        found["raises_again"] = True
    try:
        transport.send(victim, Packet(rank, 1, torch.zeros(1)))
        found["send_to_lost"] = "no error"
    except PeerLost as err:
        found["send_to_lost"] = str(err)
    started = time.monotonic()
    transport.close(timeout_s=5.0)
    found["close_seconds"] = time.monotonic() - started
    found["threads_left"] = [t.name for t in threading.enumerate() if t.name.startswith("smpart-")]
    return found


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("world", "victim", "how"), [(2, 1, "exit"), (3, 0, "sigkill"), (2, 1, "raise")])
def test_a_dead_peer_is_detected_and_the_others_exit(world: int, victim: int, how: str) -> None:
    # Rank 0 hosts the c10d store: killing it also takes the heartbeats' store away.
    survivors = set(range(world)) - {victim}
    found, exits = _spawn(_victim, world, reporting=survivors, victim=victim, how=how)
    assert exits[victim] == {"exit": 3, "sigkill": -signal.SIGKILL, "raise": 1}[how]
    for rank in survivors:
        seen = found[rank]
        assert seen["error"] is not None, f"rank {rank} never noticed rank {victim} die"
        lost_rank, message = seen["error"]
        assert lost_rank == victim and f"rank {victim} was lost" in message
        assert seen["seconds"] < 30.0
        assert seen["raises_again"]
        assert f"rank {victim} was lost" in seen["send_to_lost"]
        assert seen["close_seconds"] < 15.0
        assert seen["threads_left"] == []
        assert exits[rank] == 0


# -- scenario: a peer hangs ---------------------------------------------------------------------


def _hangs(rank: int, world: int) -> dict:
    transport = ProcessTransport(rank, world, dist.group.WORLD, heartbeat_s=0.2, lost_after_s=2.0)
    _hello(transport, rank, world)
    if rank == 1:
        _wait_until_sent(transport, world - 1)
        os.kill(os.getpid(), signal.SIGSTOP)  # alive, sockets open, silent; the parent kills it
        time.sleep(60)  # not reached: the parent kills it while stopped
        return {}
    time.sleep(0.5)
    transport.send(1, Packet(0, 1, torch.zeros(1 << 16)))  # its tensor send blocks: nobody receives
    seconds, err = _await_loss(transport, 0, 20.0)
    found: dict[str, Any] = {"seconds": seconds, "error": None if err is None else (err.rank, str(err))}
    started = time.monotonic()
    transport.close(timeout_s=1.0)  # the blocked sender and the receiver from rank 1 must be released
    found["close_seconds"] = time.monotonic() - started
    found["threads_left"] = [t.name for t in threading.enumerate() if t.name.startswith("smpart-")]
    return found


@pytest.mark.timeout(120)
def test_a_hung_peer_is_detected_by_heartbeat_and_close_releases_the_threads() -> None:
    found, exits = _spawn(_hangs, 2, reporting={0}, stray={1})
    seen = found[0]
    assert seen["error"] is not None
    lost_rank, message = seen["error"]
    assert lost_rank == 1 and "heartbeat stopped" in message
    assert seen["seconds"] < 10.0
    assert seen["close_seconds"] < 10.0
    assert seen["threads_left"] == []
    assert exits[0] == 0
