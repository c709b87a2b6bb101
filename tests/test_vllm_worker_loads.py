"""The vLLM worker's loads without vLLM: a load that fails for any reason is a load error that
vLLM recomputes, never an exception out of the step."""
import pytest

torch = pytest.importorskip("torch")

from kvtier.client import BlockClient  # noqa: E402
from kvtier.client.engines.vllm.worker_loads import WorkerLoads  # noqa: E402
from kvtier.common.blockformat import encode_block  # noqa: E402
from kvtier.client.kvcache import KVCache  # noqa: E402
from kvtier.common.keys import KVLayout, Namespace  # noqa: E402
from kvtier.kernels.paged import HND  # noqa: E402

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16", block_tokens=16)


def paged_views():
    """The layers' HND pages [block, kv, head, token, dim] of a small paged cache, zeroed."""
    return [torch.zeros(8, 2, 2, 16, 8, dtype=torch.float16) for _ in range(LAYOUT.num_layers)]


def test_a_load_whose_cache_fails_under_it_is_a_load_error_not_a_crash(kvtierd):
    views = paged_views()
    discarded = []
    loads = WorkerLoads(views, HND, lambda cache, keys: discarded.append(keys))
    keys = [bytes([i]) * 16 for i in range(1, 3)]
    with KVCache(Namespace("vllm-loads", LAYOUT), kvtierd.data_addr, hot_pool_bytes=0, transport="tcp") as cache:
        cache.store_blocks(keys, [torch.ones(LAYOUT.block_shape, dtype=torch.float16) for _ in keys])

        def closed_under_it(keys):  # what a load meets when its tenant's cache is retired mid-way
            raise RuntimeError("cannot schedule new futures after shutdown")
        cache.load_blocks = closed_under_it
        loads.start("r1", cache, keys, [3, 5], is_async=False)
        loads.wait_layer(0)
        assert loads.finish_sync() is True
    assert loads.take_errors() == {3, 5}
    assert discarded == []  # not a bad block: nothing to delete
    assert all(not view[[3, 5]].any() for view in views)
    loads.close()


def test_finish_sync_says_whether_the_steps_loads_failed(kvtierd):
    views = paged_views()
    loads = WorkerLoads(views, HND, lambda cache, keys: None)
    keys = [bytes([i]) * 16 for i in range(10, 12)]
    with KVCache(Namespace("vllm-loads-ok", LAYOUT), kvtierd.data_addr, hot_pool_bytes=0, transport="tcp") as cache:
        cache.store_blocks(keys, [torch.ones(LAYOUT.block_shape, dtype=torch.float16) for _ in keys])
        loads.start("r1", cache, keys, [1, 2], is_async=False)
        assert loads.finish_sync() is False
        loads.start("r2", cache, keys + [bytes([99]) * 16], [1, 2, 4], is_async=False)
        assert loads.finish_sync() is True
    assert loads.take_errors() == {4}
    assert all(view[[1, 2]].eq(1).all() for view in views)
    loads.close()


def test_a_bad_block_is_deleted_off_the_step_ahead_of_the_saves_queued_after_it(kvtierd):
    views = paged_views()
    keys = [bytes([i]) * 16 for i in range(20, 22)]
    good = [torch.full(LAYOUT.block_shape, float(i + 1), dtype=torch.float16) for i in range(2)]
    with KVCache(Namespace("vllm-discard", LAYOUT), kvtierd.data_addr, hot_pool_bytes=0, transport="tcp") as cache:
        loads = WorkerLoads(views, HND, lambda cache, keys: cache.delete_blocks_async(keys))
        cache.store_blocks(keys[:1], good[:1])
        with BlockClient(kvtierd.data_addr) as client:  # a well-formed block whose payload is cut short
            client.put(keys[1], encode_block(keys[1], cache.namespace.id, cache.codec.codec_id, b"\0" * 64))
            loads.start("r1", cache, keys, [1, 2], is_async=False)
            assert loads.finish_sync() is True and loads.take_errors() == {2}
            # vLLM recomputes block 1; its save, queued after the delete, replaces the bad block
            cache.store_blocks_async(keys[1:], good[1:]).result(30)
            got = cache.load_blocks(keys)
    assert all(block is not None and torch.equal(block, want) for block, want in zip(got, good))
    loads.close()
