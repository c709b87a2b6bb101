"""Write-behind saves: bounded in bytes, a full queue drops and counts, close drains."""
import threading

import pytest

from kvtier.client.save_queue import SaveQueue


def test_a_full_queue_drops_and_counts_without_waiting():
    queue = SaveQueue(bytes_max=100)
    gate, started = threading.Event(), threading.Event()
    order = []

    def slow():
        started.set()
        gate.wait(10)
        order.append("slow")
        return 2

    first = queue.submit(60, 2, slow)
    assert started.wait(10)
    second = queue.submit(40, 1, lambda: order.append("second") or 1)
    dropped_buffers = []
    third = queue.submit(1, 3, lambda: order.append("third") or 3, on_drop=lambda: dropped_buffers.append(1))
    assert third.done() and third.result() == 0 and dropped_buffers == [1]
    stats = queue.statistics()
    assert (stats.saves_queued, stats.bytes_queued, stats.saves_dropped, stats.blocks_dropped) == (2, 100, 1, 3)
    gate.set()
    assert first.result(10) == 2 and second.result(10) == 1
    assert order == ["slow", "second"]
    queue.close()
    stats = queue.statistics()
    assert (stats.saves_queued, stats.bytes_queued, stats.saves_done, stats.saves_dropped) == (0, 0, 2, 1)


def test_one_save_larger_than_the_limit_goes_in_alone():
    queue = SaveQueue(bytes_max=10)
    assert queue.submit(50, 1, lambda: 1).result(10) == 1
    queue.close()


def test_close_drains_accepted_saves_then_refuses():
    queue = SaveQueue(bytes_max=1 << 20)
    done = []
    futures = [queue.submit(10, 1, lambda i=i: done.append(i) or 1) for i in range(20)]
    queue.close()
    assert done == list(range(20)) and all(f.done() for f in futures)
    with pytest.raises(RuntimeError, match="closed"):
        queue.submit(1, 1, lambda: 1)


def test_a_failed_save_is_counted_and_raised_on_its_future():
    queue = SaveQueue(bytes_max=100)

    def boom():
        raise OSError("daemon gone")

    future = queue.submit(10, 1, boom)
    with pytest.raises(OSError, match="daemon gone"):
        future.result(10)
    queue.close()
    stats = queue.statistics()
    assert (stats.saves_failed, stats.saves_done, stats.bytes_queued) == (1, 0, 0)


def test_bad_limit():
    with pytest.raises(ValueError, match="positive"):
        SaveQueue(bytes_max=0)


def test_a_save_refused_by_a_closed_queue_gives_its_buffers_back():
    queue = SaveQueue(bytes_max=100)
    queue.close()
    given_back = []
    with pytest.raises(RuntimeError, match="closed"):
        queue.submit(10, 1, lambda: 1, on_drop=lambda: given_back.append(1))
    assert given_back == [1]
    stats = queue.statistics()
    assert (stats.saves_queued, stats.bytes_queued, stats.saves_dropped) == (0, 0, 0)


def test_saves_racing_close_are_each_run_or_refused_and_leave_no_count_behind():
    queue = SaveQueue(bytes_max=1 << 30)
    ran, refused, futures = [], [], []
    go = threading.Event()

    def submitter(n: int) -> None:
        go.wait(10)
        for i in range(200):
            try:
                futures.append(queue.submit(1, 1, lambda: ran.append(1) or 1))
            except RuntimeError:
                refused.append((n, i))

    threads = [threading.Thread(target=submitter, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    go.set()
    queue.close()
    for thread in threads:
        thread.join(10)
    assert all(f.done() for f in futures) and len(ran) == len(futures)
    assert len(futures) + len(refused) == 800
    stats = queue.statistics()
    assert (stats.saves_queued, stats.bytes_queued, stats.saves_done) == (0, 0, len(futures))
