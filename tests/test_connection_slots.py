"""The data port's slot bookkeeping (pure, a fake clock): a newcomer over max_connections that
greets takes the slot of the greeted connection longest without work; PINGs are not work; a
connection in a request is never evicted; the per-peer limit and the overflow bound hold."""
from __future__ import annotations

from kvtier.daemon.server.slots import ConnectionSlots, Slot


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def greeted(slots: ConnectionSlots, host: str, clock: Clock) -> Slot:
    slot = slots.open(host)
    assert isinstance(slot, Slot), slot
    assert slots.greeted(slot) is None
    clock.now += 1
    return slot


def test_a_newcomer_takes_the_slot_of_the_connection_longest_without_work():
    clock = Clock()
    slots = ConnectionSlots(3, 3, clock=clock)
    a, b, c = (greeted(slots, f"10.0.0.{i}", clock) for i in range(3))
    woken = []
    for slot in (a, b, c):
        slot.wake = lambda slot=slot: woken.append(slot)
    for slot in (a, c):  # work: a GET each, b only PINGs
        assert slots.begin(slot)
        slots.end(slot, work=True)
        clock.now += 1
    assert slots.begin(b)
    slots.end(b, work=False)
    newcomer = slots.open("10.0.0.9")
    assert isinstance(newcomer, Slot) and newcomer.over and slots.held() == 3
    assert slots.greeted(newcomer) is None
    assert woken == [b] and b.evicted and not newcomer.over and slots.held() == 3
    assert not slots.begin(b)  # its next request is not served
    slots.close(b)
    assert slots.evictions == 1


def test_a_connection_in_a_request_is_never_evicted_and_a_newcomer_is_refused():
    clock = Clock()
    slots = ConnectionSlots(2, 2, clock=clock)
    a, b = greeted(slots, "h", clock), greeted(slots, "g", clock)
    assert slots.begin(a) and slots.begin(b)
    newcomer = slots.open("n")
    refusal = slots.greeted(newcomer)
    assert refusal is not None and "is in a request" in refusal and not a.evicted and not b.evicted
    slots.close(newcomer)
    slots.end(a, work=True)
    later = slots.open("n")
    assert slots.greeted(later) is None and a.evicted and not b.evicted


def test_connections_that_have_not_greeted_are_not_evicted_and_overflow_is_bounded():
    clock = Clock()
    slots = ConnectionSlots(1, 10, overflow_max=2, clock=clock)
    first = slots.open("h")
    assert isinstance(first, Slot)  # has not greeted yet
    over = [slots.open("h") for _ in range(2)]
    assert all(isinstance(s, Slot) and s.over for s in over)
    refusal = slots.open("h")
    assert isinstance(refusal, str) and "max_connections 1" in refusal and "2 more waiting to greet" in refusal
    assert "in a request" in slots.greeted(over[0])  # nobody greeted is idle to give way
    slots.close(over[0])


def test_the_per_peer_limit_counts_every_connection_until_it_closes():
    clock = Clock()
    slots = ConnectionSlots(10, 2, clock=clock)
    a, b = slots.open("h"), slots.open("h")
    refusal = slots.open("h")
    assert isinstance(refusal, str) and "from h" in refusal and "max_connections_per_peer 2" in refusal
    slots.close(a)
    assert isinstance(slots.open("h"), Slot)
    assert isinstance(slots.open("other"), Slot)
