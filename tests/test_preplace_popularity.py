"""Pre-placement bookkeeping without sockets: popularity (decay, ranking, prefixes, bounds),
the observation queue, budget planning and the per-edge ledger."""
import pytest

from kvtier.daemon.preplace.budget import Candidate, held_leading, plan_within_budget
from kvtier.daemon.preplace.ledger import EdgeLedger
from kvtier.daemon.preplace.observations import ChainObserver
from kvtier.daemon.preplace.popularity import PrefixPopularity, agreeing_keys

NS_A, NS_B = b"A" * 16, b"B" * 16


def k(*ids: int) -> bytes:
    """Packed keys: key i is 16 bytes of the byte i."""
    return b"".join(bytes([i]) * 16 for i in ids)


# -- popularity ---------------------------------------------------------------------------
def test_counts_halve_every_half_life():
    pop = PrefixPopularity(half_life_s=10.0)
    pop.observe(NS_A, k(1, 2), 100.0)
    assert pop.count(NS_A, k(1), 100.0) == pytest.approx(1.0)
    assert pop.count(NS_A, k(1), 110.0) == pytest.approx(0.5)
    assert pop.count(NS_A, k(1), 130.0) == pytest.approx(0.125)
    pop.observe(NS_A, k(1, 2), 110.0)
    assert pop.count(NS_A, k(1), 110.0) == pytest.approx(1.5)
    assert pop.count(NS_B, k(1), 110.0) == 0.0  # another namespace: another head


def test_rebasing_the_weights_keeps_the_counts():
    pop = PrefixPopularity(half_life_s=1.0)
    pop.observe(NS_A, k(1), 0.0)
    pop.observe(NS_A, k(2), 100.0)  # 2**100 would be the weight: the base moves first
    pop.observe(NS_A, k(2), 100.0)
    assert pop.count(NS_A, k(1), 100.0) == pytest.approx(2.0 ** -100)
    assert pop.count(NS_A, k(2), 101.0) == pytest.approx(1.0)


def test_ranking_is_by_decayed_count_with_exact_ties_order():
    pop = PrefixPopularity(half_life_s=10.0)
    pop.observe_many([(NS_A, k(1), 0.0), (NS_A, k(1), 0.0), (NS_A, k(1), 0.0),  # 3 long ago
                      (NS_A, k(2), 20.0), (NS_A, k(2), 20.0),  # 2 recently: more than 3 x 1/4
                      (NS_B, k(3), 20.0), (NS_A, k(4), 20.0)])  # 1 each: ns A before ns B
    ranked = pop.top(20.0)
    assert [(h.ns_id, h.keys) for h in ranked] == [(NS_A, k(2)), (NS_A, k(4)), (NS_B, k(3)), (NS_A, k(1))]
    assert [h.count for h in ranked] == pytest.approx([2.0, 1.0, 1.0, 0.75])
    assert [h.keys for h in pop.top(20.0, count_max=2)] == [k(2), k(4)]


def test_prefix_is_what_most_requests_of_a_head_share():
    pop = PrefixPopularity()
    system = (1, 2, 3, 4)
    for user in range(10, 16):  # six requests: the system prompt, then each its own question
        pop.observe(NS_A, k(*system, user, user + 100), 0.0)
    (hot,) = pop.top(0.0)
    assert hot.keys == k(*system) and hot.length == 4 and hot.count == pytest.approx(6.0)
    assert hot.key_list() == [bytes([i]) * 16 for i in system]


def test_a_longer_chain_that_agrees_extends_the_prefix():
    pop = PrefixPopularity()
    pop.observe(NS_A, k(1, 2), 0.0)
    pop.observe(NS_A, k(1, 2, 3, 4), 0.0)  # reach: 2 2 1 1 -> all >= half of 2
    assert pop.top(0.0)[0].keys == k(1, 2, 3, 4)
    pop.observe(NS_A, k(1), 0.0)
    pop.observe(NS_A, k(1), 0.0)  # reach: 4 2 1 1 -> only k1, k2 (2 >= 0.5 x 4)
    assert pop.top(0.0)[0].keys == k(1, 2)
    assert pop.statistics().keys_tracked == 4


def test_an_uncommon_branch_is_replaced_a_common_one_kept():
    pop = PrefixPopularity()
    pop.observe(NS_A, k(1, 2, 3), 0.0)
    pop.observe(NS_A, k(1, 2, 3), 0.0)
    pop.observe(NS_A, k(1, 2, 9), 0.0)  # leaves at depth 2; the kept k3 is reached by 2 of 3: kept
    assert pop.top(0.0)[0].keys == k(1, 2, 3)
    pop.observe(NS_A, k(1, 7), 0.0)  # depth 1; k2 reached by 3 of 4: kept
    pop.observe(NS_A, k(1, 7), 0.0)
    pop.observe(NS_A, k(1, 7), 0.0)  # k2: 3 of 6 -- not below half: kept (k3, 2 of 6, is past the prefix)
    assert pop.top(0.0)[0].keys == k(1, 2)
    pop.observe(NS_A, k(1, 7, 8), 0.0)  # k2: 3 of 7 < half: this branch replaces it
    assert pop.top(0.0)[0].keys == k(1, 7, 8)[:16]  # k7 reached by 1 of 7: the prefix is the head alone
    pop.observe_many([(NS_A, k(1, 7, 8), 0.0)] * 6)  # k7: 7 of 13
    assert pop.top(0.0)[0].keys == k(1, 7, 8)
    assert pop.statistics().keys_tracked == 3


def test_bounded_heads_evict_the_least_popular_exactly():
    pop = PrefixPopularity(half_life_s=10.0, heads_max=3)
    pop.observe_many([(NS_A, k(1), 0.0)] * 3 + [(NS_A, k(2), 0.0)] * 2 + [(NS_A, k(3), 0.0)])
    pop.observe(NS_A, k(4), 0.0)  # four heads: k3 (1) and k4 (1) tie; the smaller head (k3) goes
    assert [h.keys for h in pop.top(0.0)] == [k(1), k(2), k(4)]
    pop.observe(NS_A, k(5), 30.0)  # k1 is now 3/8, k2 2/8, k4 1/8 < k5's 1
    assert [h.keys for h in pop.top(30.0)] == [k(5), k(1), k(2)]
    s = pop.statistics()
    assert (s.heads_tracked, s.heads_evicted, s.observations) == (3, 2, 8)


def test_bounded_keys_and_prefix_length():
    pop = PrefixPopularity(keys_max=5, prefix_keys_max=3)
    pop.observe(NS_A, k(1, 2, 3, 4, 5), 0.0)  # kept: 3 keys
    pop.observe(NS_A, k(1, 2, 3), 0.0)
    pop.observe(NS_A, k(9, 8, 7), 0.0)  # 6 keys held > 5: the less popular head (k9) goes
    assert [h.keys for h in pop.top(0.0)] == [k(1, 2, 3)]
    assert pop.statistics().keys_tracked == 3


def test_a_chain_remainder_counts_for_its_head_not_as_a_head_of_its_own():
    pop = PrefixPopularity()
    for _ in range(3):  # a client LOOKUPs the whole chain, then GETs the blocks it lacks: the tail
        pop.observe_many([(NS_A, k(9, 8, 7, 6), 0.0), (NS_A, k(7, 6), 0.0)])
    assert [(h.keys, h.count) for h in pop.top(0.0)] == [(k(9, 8, 7, 6), pytest.approx(6.0))]
    s = pop.statistics()
    assert (s.heads_tracked, s.keys_tracked, s.observations) == (1, 4, 6)
    candidates = [Candidate(h.ns_id, h.key_list(), [10] * h.length) for h in pop.top(0.0)]
    assert [p.keys for p in plan_within_budget(candidates, 20)] == [tuple(keys(9, 8))]  # the leading blocks


def test_a_remainder_seen_before_its_chain_is_folded_into_it():
    pop = PrefixPopularity()
    pop.observe_many([(NS_A, k(7, 6), 0.0)] * 2)  # an edge that holds 9, 8 asks the region for the rest
    pop.observe_many([(NS_B, k(9, 8, 7, 6), 0.0)])  # another namespace: not the same chain
    assert [h.keys for h in pop.top(0.0)] == [k(7, 6), k(9, 8, 7, 6)]
    pop.observe_many([(NS_A, k(9, 8, 7, 6), 0.0)])
    assert [(h.ns_id, h.keys, h.count) for h in pop.top(0.0)] == [(NS_A, k(9, 8, 7, 6), pytest.approx(3.0)),
                                                                  (NS_B, k(9, 8, 7, 6), pytest.approx(1.0))]
    assert pop.statistics().heads_tracked == 2 and pop.statistics().keys_tracked == 8


def test_a_remainder_extends_its_head_or_leaves_its_common_branch():
    pop = PrefixPopularity(prefix_keys_max=5)
    pop.observe_many([(NS_A, k(1, 2, 3), 0.0), (NS_A, k(3, 4, 5, 6), 0.0)])  # runs past the kept keys: to the cap
    assert [(h.keys, h.count) for h in pop.top(0.0)] == [(k(1, 2, 3, 4, 5), pytest.approx(2.0))]
    pop.observe_many([(NS_A, k(2, 9), 0.0)])  # leaves at depth 2: reach 3 3 2 1 1, the kept 3 stays
    assert [(h.keys, h.count) for h in pop.top(0.0)] == [(k(1, 2, 3), pytest.approx(3.0))]
    pop.observe_many([(NS_A, k(2, 3, 4), 0.0), (NS_A, k(3, 4, 5), 0.0), (NS_A, k(4, 5), 0.0)])  # 6 6 5 4 3
    assert [(h.keys, h.count) for h in pop.top(0.0)] == [(k(1, 2, 3, 4, 5), pytest.approx(6.0))]
    assert pop.statistics().heads_tracked == 1 and pop.statistics().keys_tracked == 5


def test_a_remainder_of_a_remainder_folds_through_it():
    pop = PrefixPopularity()
    pop.observe_many([(NS_A, k(1, 2, 3), 0.0), (NS_A, k(3, 4, 5), 0.0), (NS_A, k(5, 6), 0.0)])
    assert [(h.keys, h.count) for h in pop.top(0.0)] == [(k(1, 2, 3, 4, 5), pytest.approx(3.0))]  # reach 3 3 3 2 2 1
    pop.observe_many([(NS_A, k(5, 6), 0.0), (NS_A, k(4, 5), 0.0)])  # in a later batch: reach 5 5 5 4 4 2
    assert [(h.keys, h.count) for h in pop.top(0.0)] == [(k(1, 2, 3, 4, 5), pytest.approx(5.0))]
    assert pop.statistics().heads_tracked == 1 and pop.statistics().keys_tracked == 6
    loop = PrefixPopularity()  # keys that are no chain (each head inside the other) still fold once
    loop.observe_many([(NS_A, k(1, 2), 0.0), (NS_A, k(2, 1), 0.0)])
    assert [(h.keys, h.count) for h in loop.top(0.0)] == [(k(1, 2, 1), pytest.approx(2.0))]


def test_bad_keys_are_refused():
    pop = PrefixPopularity()
    with pytest.raises(ValueError, match="whole number of 16-byte keys"):
        pop.observe(NS_A, b"x" * 17, 0.0)
    pop.observe(NS_A, b"", 0.0)  # an empty chain counts nothing
    assert pop.statistics().heads_tracked == 0


def test_agreeing_keys():
    assert agreeing_keys(k(1, 2, 3), k(1, 2, 3, 4)) == 3
    assert agreeing_keys(k(1, 2, 3), k(1, 5, 3)) == 1
    assert agreeing_keys(k(1), k(2)) == 0


# -- the observation queue ------------------------------------------------------------------
def test_observer_queues_in_order_and_counts_what_it_drops():
    times = iter([1.0, 2.0, 3.0])
    obs = ChainObserver(clock=lambda: next(times), queued_max=2)
    obs.observe(NS_A, k(1))
    obs.observe(None, k(2, 3))
    obs.observe(NS_A, k(4))  # over the queue's bound: dropped
    obs.observe(NS_A, b"")  # nothing to count
    assert obs.drain() == [(NS_A, k(1), 1.0), (None, k(2, 3), 2.0)]
    assert obs.drain() == []
    assert obs.counts() == (2, 1)


def test_observer_bounds_the_bytes_it_queues():
    obs = ChainObserver(clock=lambda: 0.0, queued_bytes_max=48)
    obs.observe(NS_A, k(1, 2))
    obs.observe(NS_A, k(3, 4))  # 64 bytes queued would be over 48: dropped
    obs.observe(NS_A, k(5))
    assert [keys for _, keys, _ in obs.drain()] == [k(1, 2), k(5)]
    obs.observe(NS_A, k(3, 4))  # the drain made room
    assert obs.counts() == (3, 1)


# -- budget ---------------------------------------------------------------------------------
def keys(*ids):
    return [bytes([i]) * 16 for i in ids]


def test_plan_takes_ranked_prefixes_within_the_budget_and_dedups():
    a = Candidate(NS_A, keys(1, 2, 3), [10, 10, 10])
    b = Candidate(NS_A, keys(2, 3), [10, 10])  # a continuation of A: costs nothing more
    c = Candidate(NS_B, keys(4, 5, 6), [10, 10, 10])
    d = Candidate(NS_B, keys(7), [1])
    plan = plan_within_budget([a, b, c, d], 50)
    assert [(p.ns_id, p.keys, p.sizes) for p in plan] == [(NS_A, tuple(keys(1, 2, 3)), (10, 10, 10)),
                                                         (NS_B, tuple(keys(4, 5)), (10, 10))]
    assert sum(p.size_bytes for p in plan) == 50  # c is cut where it stops fitting; d is not taken
    assert plan_within_budget([a], 9) == []


def test_plan_cuts_a_prefix_at_its_first_block_the_region_lacks():
    assert held_leading([5, 5, 0, 5]) == 2 and held_leading([5, 5]) == 2 and held_leading([0]) == 0
    plan = plan_within_budget([Candidate(NS_A, keys(1, 2, 3, 4), [5, 5, 0, 5]),
                               Candidate(NS_A, keys(8), [0])], 100)
    assert [p.keys for p in plan] == [tuple(keys(1, 2))]


def test_plan_counts_what_the_edge_already_holds():
    a = Candidate(NS_A, keys(1, 2), [10, 10])
    b = Candidate(NS_A, keys(3, 4), [10, 10])
    held = {keys(9)[0]: 20, keys(3)[0]: 10}  # an old prefix (k9) and one block of b
    plan = plan_within_budget([a, b], 50, held)  # 30 held: 20 left for a; b's held k3 is free, k4 is not
    assert [p.keys for p in plan] == [tuple(keys(1, 2)), tuple(keys(3))]
    plan = plan_within_budget([b, a], 50, held)  # b's k3 is free; k4 costs 10; then 10 left: a's k1
    assert [p.keys for p in plan] == [tuple(keys(3, 4)), tuple(keys(1))]
    with pytest.raises(ValueError, match="2 keys but 1 sizes"):
        plan_within_budget([Candidate(NS_A, keys(1, 2), [1])], 10)


# -- ledger -----------------------------------------------------------------------------------
def test_ledger_expires_and_separates_the_pushers_pins_from_an_operators():
    ledger = EdgeLedger()
    ledger.record(keys(1, 2), [10, 20], expires_s=100.0, auto=True)
    ledger.record(keys(3), [5], expires_s=50.0, auto=False)
    ledger.record(keys(2), [20], expires_s=80.0, auto=False)  # an operator's now, the later deadline kept
    assert ledger.live_auto(10.0) == {keys(1)[0]: 10}
    assert ledger.live_bytes(10.0) == (3, 35)
    assert ledger.live_bytes(60.0) == (2, 30)
    assert ledger.live_bytes(100.0) == (0, 0)


def test_ledger_is_bounded_forgetting_the_soonest_to_expire():
    ledger = EdgeLedger(keys_max=2)
    ledger.record(keys(1, 2, 3), [1, 1, 1], expires_s=10.0, auto=True)
    ledger.record(keys(4), [1], expires_s=5.0, auto=True)
    assert len(ledger) == 2 and ledger.live_auto(0.0).keys() <= set(keys(1, 2, 3))
