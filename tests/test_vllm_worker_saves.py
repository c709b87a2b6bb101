"""The vLLM worker's saves without vLLM: the gather into a staging buffer is the step's only copy,
and a staging buffer is not reused while saves still read it."""
import threading
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from kvtier.client.engines.vllm.worker_saves import WorkerSaves  # noqa: E402
from kvtier.client.kvcache import KVCache  # noqa: E402
from kvtier.common.keys import KVLayout, Namespace  # noqa: E402
from kvtier.kernels.paged import HND  # noqa: E402

from daemon_proc import start_kvtierd  # noqa: E402

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16", block_tokens=16)


@pytest.fixture
def daemon(tmp_path):
    d = start_kvtierd(tmp_path)
    yield d
    d.stop()


def _block(views, page: int):
    """Page ``page`` as a kvtier block [L, 2, H, T, D] (HND pages are [kv, head, token, dim])."""
    return torch.stack([view[page] for view in views])


def test_pages_reused_after_the_step_are_saved_as_they_were_and_staging_is_not_reused_early(daemon):
    gen = torch.Generator().manual_seed(1)
    views = [torch.randn(8, 2, 2, 16, 8, generator=gen).half() for _ in range(LAYOUT.num_layers)]  # HND pages
    saves = WorkerSaves(views, HND)
    keys = [bytes([i]) * 16 for i in range(1, 4)]
    before = [_block(views, page).clone() for page in (1, 3, 5)]
    gate = threading.Event()
    with KVCache(Namespace("vllm-saves", LAYOUT), daemon.data_addr, hot_pool_bytes=0, transport="tcp") as cache:
        blocker = cache._saves.submit(0, 0, lambda: gate.wait(30) and 0)
        stagings = []
        for pages, step_keys in (([1, 3], keys[:2]), ([5], keys[2:])):
            saves.begin(pages)
            for layer in range(LAYOUT.num_layers):
                saves.gather_layer(layer)
            stagings.append(saves._staging.data_ptr())
            saves.submit([SimpleNamespace(num_blocks=len(pages), keys=[step_keys])], lambda op: cache, 0)
            for view in views:
                view[pages] = 0  # vLLM reuses the pages once the step returns
        assert stagings[0] != stagings[1]  # the first step's saves were still queued
        gate.set()
        blocker.result(30)
        assert saves.wait_stored(30)
        loaded = cache.load_blocks(keys)
        assert all(got is not None and torch.equal(got, want) for got, want in zip(loaded, before))
        saves.begin([2])
        saves.gather_layer(0)
        assert saves._staging.data_ptr() in stagings  # an idle staging buffer is taken again
