"""The transport's endpoints: one handler at a time, each sender's messages in order, nothing lost.

An `Endpoint` is a stage server's address: the transport delivers its messages on whatever thread
they arrive on, and the endpoint's own thread hands them to its handler, one at a time.
"""

from __future__ import annotations

import threading
import time

import pytest

from smpart.runtime.wire.transport import Endpoint


def _serve(endpoint: Endpoint, stop: threading.Event) -> threading.Thread:
    def loop() -> None:
        while not stop.is_set():
            endpoint.serve_one(0.01)

    thread = threading.Thread(target=loop, name="test-endpoint")
    thread.start()
    return thread


@pytest.mark.timeout(60)
def test_one_handler_at_a_time_and_each_senders_messages_in_order():
    senders, count = 4, 400
    seen: dict[int, list[int]] = {s: [] for s in range(senders)}
    inside = [0]
    overlaps = [0]

    def handler(message: tuple[int, int]) -> None:
        inside[0] += 1
        if inside[0] > 1:
            overlaps[0] += 1
        sender, seq = message
        seen[sender].append(seq)
        if seq % 7 == 0:
            time.sleep(0)  # let other threads in while this one handles
        inside[0] -= 1

    endpoint = Endpoint(handler)
    stop = threading.Event()
    server = _serve(endpoint, stop)

    def send(sender: int) -> None:
        for seq in range(count):
            endpoint.deliver((sender, seq))

    threads = [threading.Thread(target=send, args=(s,)) for s in range(senders)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        deadline = time.monotonic() + 10
        while sum(map(len, seen.values())) < senders * count and time.monotonic() < deadline:
            time.sleep(0.005)
    finally:
        stop.set()
        server.join(5)
    assert overlaps[0] == 0
    assert all(seen[s] == list(range(count)) for s in range(senders))


@pytest.mark.timeout(30)
def test_messages_wait_for_the_endpoints_own_thread_and_early_ones_for_its_handler():
    order: list[str] = []
    depth = [0]
    second = Endpoint(None)  # no handler yet: what arrives waits

    def first_handler(message: str) -> None:
        depth[0] += 1
        order.append(f"first {message} depth {depth[0]}")
        second.deliver(message)  # queued, not handled inside this handler
        depth[0] -= 1

    def second_handler(message: str) -> None:
        depth[0] += 1
        order.append(f"second {message} depth {depth[0]}")
        depth[0] -= 1

    first = Endpoint(first_handler)
    first.deliver("a")
    first.deliver("b")
    assert order == [], "delivering only queues: the handler runs on the endpoint's own thread"
    while first.serve_one(0.01):
        pass
    assert order == ["first a depth 1", "first b depth 1"]
    second.handler = second_handler
    second.deliver("c")  # two messages queued before it: it waits behind them
    assert order == ["first a depth 1", "first b depth 1"]
    while second.serve_one(0.01):
        pass
    assert order[2:] == ["second a depth 1", "second b depth 1", "second c depth 1"]
