"""Time to load a prefix of N blocks from each tier, for ``perf/bench_cdn.py``: hot (the engine's
own pool), warm (the edge kvtierd holds it), cold (the edge fetches it from the region across
the WAN), with the same load from the region directly across the same WAN as the reference,
and the prefill of the same tokens by a random-weight Llama as the recompute estimate.

The WAN (``tests/wan_link.py``): the region in its own network namespace behind a veth pair,
tbf at 1 Gbit/s on both ends, 20 ms added per reply frame by a delay proxy (this kernel has
tbf, not netem). Without root or ``ip netns`` the region runs on loopback behind the same
delay proxy, unshaped; ``wan`` in the result says which it was.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from daemon_proc import start_kvtierd  # noqa: E402
from upstream_proxy import FrameProxy  # noqa: E402
from wan_link import REGION_TOKEN as WAN_TOKEN, WAN_DELAY_S, start_wan_region, wan_namespace  # noqa: E402
from kvtier.client.kvcache import KVCache  # noqa: E402
from kvtier.common.keys import KVLayout, Namespace  # noqa: E402

# the KV shape of tools/kvperf's "random-llama" (6 layers, 4 KV heads x 64): 96 KiB of fp16 per 16-token block
TTFT_LLAMA = dict(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=6,
                  num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=8192)
TTFT_LAYOUT = KVLayout(num_layers=6, num_kv_heads=4, head_dim=64, dtype="float16", block_tokens=16)
TTFT_NAMESPACE = Namespace(model="cdn-bench-ttft", layout=TTFT_LAYOUT, codec="raw")
WAN_LOOPBACK = "loopback + 20 ms per reply frame (delay proxy), no rate limit"
WAN_SHAPED = "netns + veth, tbf 1gbit both ends + 20 ms per reply frame (delay proxy)"
REGION_TOKEN = "cdn-ttft-region-secret"


@contextmanager
def wan_region(workdir: Path):
    """``(proxy address, region address without the delay, token, wan description)``."""
    token_file = workdir / "region-token"
    with ExitStack() as stack:
        link = None
        try:
            if os.geteuid() != 0:
                raise PermissionError("network namespaces need root")
            netns = stack.enter_context(wan_namespace())
            link = start_wan_region(netns, workdir / "region", token_file)
            stack.callback(link.close)
        except (OSError, subprocess.CalledProcessError) as exc:
            print(f"ttft: no network namespace ({exc}); region on loopback behind the delay proxy", flush=True)
        if link is not None:
            yield link.proxy.address, link.address, WAN_TOKEN, WAN_SHAPED
            return
    token_file.write_text(REGION_TOKEN + "\n")
    region = start_kvtierd(workdir / "region", "--token-file", str(token_file), "--device-size", "256m",
                           "--region-size", "8m")
    proxy = FrameProxy(region.data_addr)
    proxy.delay_s = WAN_DELAY_S
    try:
        yield proxy.address, region.data_addr, REGION_TOKEN, WAN_LOOPBACK
    finally:
        proxy.close()
        region.stop()


def random_prefix(blocks: int, seed: int) -> tuple[list[int], list]:
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, TTFT_LLAMA["vocab_size"], (blocks * TTFT_LAYOUT.block_tokens,),
                           generator=generator).tolist()
    shape = (1, TTFT_LAYOUT.num_kv_heads, len(tokens), TTFT_LAYOUT.head_dim)
    kv = [(torch.randn(shape, generator=generator).to(torch.float16),
           torch.randn(shape, generator=generator).to(torch.float16)) for _ in range(TTFT_LAYOUT.num_layers)]
    return tokens, kv


def timed_load(cache: KVCache, tokens: list[int], blocks: int, transport: str | None = None) -> float:
    """Wall time of one load of the whole prefix, every block from ``transport`` (None: the pool)."""
    started = time.perf_counter()
    loaded = cache.load(tokens)
    elapsed = time.perf_counter() - started
    served = loaded.blocks_hot if transport is None else loaded.transports.get(transport, 0)
    assert served == blocks, f"{served} of {blocks} blocks from {transport or 'the pool'}: {loaded.transports}"
    return elapsed


def recompute_s(tokens: list[int], reps: int) -> list[float]:
    """Prefill of ``tokens`` by a random-weight Llama with the layout's KV shape (CPU, fp32)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**TTFT_LLAMA)).eval()
    ids = torch.tensor([tokens])
    out = []
    with torch.inference_mode():
        model(ids[:, :16], use_cache=True)  # warm-up
        for _ in range(reps):
            started = time.perf_counter()
            model(ids, use_cache=True)
            out.append(time.perf_counter() - started)
    return out


def measure_tiers(workdir: Path, blocks: int, reps: int, recompute: bool, progress=print) -> dict:
    """Per tier the load times (s) of ``reps`` fresh prefixes of ``blocks`` blocks."""
    workdir.mkdir(parents=True, exist_ok=True)
    samples: dict[str, list[float]] = {"hot": [], "warm": [], "cold": [], "region_direct_over_wan": []}
    with wan_region(workdir) as (proxy_addr, region_addr, token, wan):
        (workdir / "edge-upstream-token").write_text(token + "\n")
        edge = start_kvtierd(workdir / "edge", "--upstream", proxy_addr, "--upstream-token-file",
                             str(workdir / "edge-upstream-token"), "--upstream-timeout-ms", "5000",
                             "--device-size", "256m", "--region-size", "8m")
        try:
            prefix_bytes = blocks * TTFT_LAYOUT.block_raw_bytes
            with KVCache(TTFT_NAMESPACE, region_addr, token=token, hot_pool_bytes=0, transport="tcp") as seeder, \
                    KVCache(TTFT_NAMESPACE, proxy_addr, token=token, hot_pool_bytes=0, transport="tcp") as direct, \
                    KVCache(TTFT_NAMESPACE, edge.data_addr, hot_pool_bytes=0, transport="tcp") as at_edge, \
                    KVCache(TTFT_NAMESPACE, edge.data_addr, hot_pool_bytes=4 * prefix_bytes,
                            transport="tcp") as with_pool:
                prefixes = [random_prefix(blocks, seed) for seed in range(reps + 1)]  # the first warms up
                for tokens, kv in prefixes:
                    seeder.store(tokens, kv)  # at the region only
                for i, (tokens, _) in enumerate(prefixes):
                    samples["region_direct_over_wan"].append(timed_load(direct, tokens, blocks, "tcp"))
                    samples["cold"].append(timed_load(at_edge, tokens, blocks, "upstream"))
                    progress(f"ttft: rep {i}/{reps}: region direct {1000 * samples['region_direct_over_wan'][-1]:.1f} ms,"
                             f" edge cold {1000 * samples['cold'][-1]:.1f} ms")
                for tokens, _ in prefixes:  # every prefix was fetched cold once: now the edge holds it
                    samples["warm"].append(timed_load(at_edge, tokens, blocks, "tcp"))
                for tokens, _ in prefixes:
                    with_pool.load(tokens)  # into the engine's pool
                    samples["hot"].append(timed_load(with_pool, tokens, blocks))
                samples = {tier: times[1:] for tier, times in samples.items()}  # without the warm-up's
                if recompute:
                    progress("ttft: prefill by a random-weight Llama (recompute)")
                    samples["recompute"] = recompute_s(prefixes[0][0], max(3, reps // 3))
        finally:
            edge.stop()
    return {"wan": wan, "blocks": blocks, "block_tokens": TTFT_LAYOUT.block_tokens,
            "block_raw_bytes": TTFT_LAYOUT.block_raw_bytes, "prefix_bytes": blocks * TTFT_LAYOUT.block_raw_bytes,
            "reps": reps, "samples_s": samples}


__all__ = ["TTFT_LAYOUT", "TTFT_LLAMA", "measure_tiers", "recompute_s", "wan_region"]
