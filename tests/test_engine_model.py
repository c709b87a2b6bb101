"""A model of the engine, as a hypothesis rule-based state machine: puts (buffered and durable, of
sizes that fill regions exactly and not), hard pins, soft pins, unpins, deletes, reads, a PIN that
runs while a writer waits for a region (and the reclaim worker is behind), and crash-restarts, driven
against the real engine on memory devices and checked against a plain Python model after every step:

- no PUT is refused for lack of room while the store holds evictable blocks (pins are kept under
  PINNED_SHARE_MAX of the capacity, so it always does);
- a block read back is the block stored, or a miss (a cache evicts), never other bytes;
- a hard-pinned block is never evicted, and its pin survives a crash;
- a deleted key is never served again, a crash included;
- once the reclaim worker is idle, a clean region waits for its next compaction (the reserve) and
  no region is held for it.

``KVTIER_MODEL_EXAMPLES`` sets how many sequences run (the suite's default is small; ``make soak``
runs many more)."""
from __future__ import annotations

import os

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, invariant, rule

from kvtier.daemon.engine import Engine, NoSpaceError

from test_engine import PAYLOAD_5_PER_REGION, REGION, block, key, mem_engine, same_block
from test_engine_reserve import WAIT_S, WRITER_PAYLOAD, writer_behind_a_pin

REGIONS = 6
PINNED_SHARE_MAX = 0.15  # of the store's capacity: far below what makes reclaim impossible
SIZES = (4_000, WRITER_PAYLOAD, 100_000, PAYLOAD_5_PER_REGION)
EXAMPLES = int(os.environ.get("KVTIER_MODEL_EXAMPLES", "25"))


class EngineModel(RuleBasedStateMachine):
    ids = Bundle("ids")

    def __init__(self):
        super().__init__()
        self.engine, self.cfg, self.devs = mem_engine(regions=REGIONS)
        self.stored: dict[int, bytes] = {}  # id -> the block last stored under its key
        self.durable: set[int] = set()
        self.pinned: set[int] = set()  # hard pins acknowledged
        self.soft_pinned: set[int] = set()  # soft pins (they count towards the pinned share too)
        self.deleted: set[int] = set()
        self.next_id = 0

    def teardown(self):
        self.engine.close()

    def _new_id(self) -> int:
        self.next_id += 1
        return self.next_id

    def _pinned_bytes(self) -> int:
        return sum(len(self.stored[i]) for i in self.pinned | self.soft_pinned)

    # -- rules ------------------------------------------------------------------------
    @rule(target=ids, size=st.sampled_from(SIZES), durable=st.booleans())
    def put(self, size, durable):
        i = self._new_id()
        blk = block(i, size)
        try:
            self.engine.put_many([blk], durable=durable)
        except NoSpaceError as exc:
            raise AssertionError(f"a PUT was refused with {self._pinned_bytes()} bytes pinned: {exc}") from None
        self.stored[i] = blk
        if durable:
            self.durable.add(i)
        return i

    @rule(i=ids)
    def pin(self, i):
        if i in self.deleted or self._pinned_bytes() + len(self.stored[i]) > PINNED_SHARE_MAX * REGIONS * REGION:
            return
        (present,) = self.engine.pin_many([key(i)])
        if present:
            self.pinned.add(i)
            self.durable.add(i)  # the pin's commit wrote the open region's prefix too
        else:
            assert i not in self.pinned, f"pinned block {i} was gone when pinned again"

    @rule(i=ids)
    def soft_pin(self, i):
        if i in self.deleted or self._pinned_bytes() + len(self.stored[i]) > PINNED_SHARE_MAX * REGIONS * REGION:
            return
        if self.engine.pin_many([key(i)], ttl_s=60.0)[0]:
            self.soft_pinned.add(i)

    @rule(i=ids)
    def unpin(self, i):
        self.engine.unpin_many([key(i)])
        self.pinned.discard(i)
        self.soft_pinned.discard(i)

    @rule(i=ids)
    def delete(self, i):
        self.engine.delete_many([key(i)])
        self.deleted.add(i)
        self.pinned.discard(i)
        self.soft_pinned.discard(i)

    @rule(i=ids)
    def get(self, i):
        got = self.engine.get(key(i))
        if i in self.deleted:
            assert got is None, f"deleted block {i} was served"
        elif got is not None:
            assert same_block(got, self.stored[i]), f"block {i} came back with other bytes"
        assert got is not None or i not in self.pinned, f"pinned block {i} was evicted"

    @rule(size=st.sampled_from(SIZES), i=ids)
    def pin_while_a_writer_waits(self, size, i):
        """A writer of blocks that need new regions, run ahead of the reclaim worker, lets a PIN run
        the first time it waits for a clean region."""
        if i in self.deleted or self._pinned_bytes() + len(self.stored[i]) > PINNED_SHARE_MAX * REGIONS * REGION:
            return
        first = self.next_id + 1
        self.next_id += 40
        failures, pinned = writer_behind_a_pin(self.engine, [block(first + j, size) for j in range(40)], key(i))
        assert not failures, f"a PUT was refused with {self._pinned_bytes()} bytes pinned: {failures[0]}"
        for j in range(40):
            self.stored[first + j] = block(first + j, size)
        if pinned:
            self.pinned.add(i)
            self.durable.add(i)

    @rule()
    def crash_and_restart(self):
        """The old engine fails and stops, writing nothing more (what it had not written is lost:
        buffered blocks may be missing after, never wrong; its soft pins with it)."""
        self.engine.fail("crash_and_restart")
        self.engine.close()
        self.engine = Engine.open(self.cfg, devices=self.devs)
        self.soft_pinned.clear()

    # -- checked after every step ----------------------------------------------------------
    @invariant()
    def pinned_blocks_are_there(self):
        for i in sorted(self.pinned):
            assert same_block(self.engine.get(key(i)), self.stored[i]), f"pinned block {i} lost or wrong"

    @invariant()
    def a_clean_region_waits_for_the_next_compaction(self):
        with self.engine._lock:
            self.engine._regions.wait_idle(WAIT_S)
            assert self.engine._table.free_count >= self.engine._regions._reserve, "the reserve was spent"
            assert self.engine._allocator.held_region is None

    @invariant()
    def deleted_keys_stay_deleted(self):
        for i in sorted(self.deleted):
            assert self.engine.lookup([key(i)]) == 0, f"deleted key {i} came back"


EngineModel.TestCase.settings = settings(max_examples=EXAMPLES, stateful_step_count=30, deadline=None,
                                         suppress_health_check=[HealthCheck.too_slow])
test_engine_model = EngineModel.TestCase

