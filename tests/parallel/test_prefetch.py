"""Batches prepared ahead: order kept, errors raised in the consumer, the thread stopped."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from evendp._parallel._prefetch import Prefetcher


def test_items_arrive_in_order_and_a_producer_error_reaches_the_consumer() -> None:
    def produce() -> Iterator[int]:
        yield from range(5)
        raise ValueError("bad sample 5")

    got = []
    with Prefetcher(produce, depth=2) as ahead, pytest.raises(ValueError, match="bad sample"):
        for item in ahead:
            got.append(item)
    assert got == [0, 1, 2, 3, 4]


def test_leaving_early_stops_a_producer_blocked_on_a_full_queue() -> None:
    def endless() -> Iterator[int]:
        n = 0
        while True:
            yield n
            n += 1

    before = threading.active_count()
    with Prefetcher(endless, depth=2) as ahead:
        assert [next(ahead) for _ in range(3)] == [0, 1, 2]
    assert threading.active_count() == before  # joined, not left running
