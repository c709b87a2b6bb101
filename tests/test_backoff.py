"""Backoff (kvtier.common.backoff): pauses double up to the cap, reset starts again, a deadline cuts one short."""
import time

import pytest

from kvtier.common.backoff import Backoff


def test_pauses_double_up_to_the_cap_and_reset_starts_again():
    backoff = Backoff(10e-6, 50e-6)
    assert [backoff.next_s() for _ in range(5)] == pytest.approx([10e-6, 20e-6, 40e-6, 50e-6, 50e-6])
    backoff.reset()
    assert backoff.next_s() == pytest.approx(10e-6)


def test_a_deadline_that_has_passed_does_not_sleep(monkeypatch):
    slept = []
    monkeypatch.setattr(time, "sleep", slept.append)
    backoff = Backoff(1.0, 8.0)
    backoff.sleep(deadline=time.monotonic() - 1)
    backoff.sleep(deadline=time.monotonic() + 100)
    backoff.sleep()
    assert slept == [2.0, 4.0]  # the first pause was cut to nothing, and still counted


@pytest.mark.parametrize("first_s, max_s", [(0, 1), (-1e-6, 1), (2e-3, 1e-3)])
def test_bad_bounds_are_refused(first_s, max_s):
    with pytest.raises(ValueError, match="first_s"):
        Backoff(first_s, max_s)
