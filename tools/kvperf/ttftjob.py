"""The ttft workload: time to first token with and without kvtier, on a real model.

For each prompt (``prompt_tokens`` long, of which the first ``cached_tokens``
-- rounded down to whole blocks -- were stored beforehand), four modes::

    recompute  model(prompt)                                     full prefill
    inmemory   model(suffix, cache=DynamicCache(prefix KV))      the ideal: KV already in memory
    load       KVCache.load(prompt)                              the load alone: fetch and decode, no model
    kvtier     lookup + load prefix from the daemon + model(suffix)   (kvtier.client.engines.transformers)

and, from their means, what a pipelined load is judged by::

    exposed_load_ms   = kvtier - inmemory          the part of the load that TTFT still waits for
    load_vs_inmemory  = load / inmemory            how much the load matters on this model and machine
    exposed_vs_load   = exposed_load_ms / load     0: fully hidden behind the prefill, 1: not at all
    kvtier_vs_bound   = kvtier / max(inmemory, load)   1: as fast as the slower of the two alone

Each concurrency level (``concurrency=1,8,16``) runs ``max(ttft_prompts,
level)`` prompts per mode with ``level`` of them in flight (threads), and
reports mean/p99 times and prompts/s. At concurrency 1 the four modes of each prompt run back
to back, prompt after prompt, so a machine that slows down for a while slows every mode alike
and ``exposed_load_ms`` (a difference of two means) does not take the drift for the load's.
Prompts differ from each other and the hot pool is off, so every load comes from the daemon, through ``ttft_transport``
(the stored prefixes are flushed first: sealed, as direct reads need); the
report counts the timed loads' blocks by the transport that carried them. The model is one of the
random-weight Llamas of :mod:`.models` (no download) unless ``model=`` names
a local checkpoint directory. ``ttft_threads`` sets the model's torch threads on the CPU (its
report says how many ran): on a GPU host the model's compute does not take the cores the load
runs on, and fewer threads than cores is how a CPU host leaves them. With ``verify`` and the
raw codec, the kvtier logits must equal the in-memory ones and the KV loaded alone the stored KV,
exactly; every stored block must load.
"""
from __future__ import annotations

import hashlib
import inspect
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from .models import builtin_config
from .options import JobOptions
from .result import ConnectError
from .stats import ms_stats
from .targets import Targets
from .units import UsageError

RANDOM_LLAMA_SEED = 0
WARMUP_PROMPTS = 1  # untimed runs of each mode first: torch's first call allocates and picks kernels
MODES = ("recompute", "inmemory", "load", "kvtier")
NIXL_READY_TIMEOUT_S = 30.0  # the background NIXL setup, waited for before anything is timed


def _ratio(num: float, den: float) -> float | None:
    """None (JSON null, which no gate passes) where the denominator is not a time."""
    return num / den if den > 0 else None


def load_figures(inmemory_ms: float, load_ms: float, kvtier_ms: float) -> dict:
    """What a pipelined load is judged by, from the modes' mean times (ms)."""
    exposed_ms = kvtier_ms - inmemory_ms
    return {"exposed_load_ms": exposed_ms,
            "load_vs_inmemory": _ratio(load_ms, inmemory_ms),
            "exposed_vs_load": _ratio(exposed_ms, load_ms),
            "kvtier_vs_bound": _ratio(kvtier_ms, max(inmemory_ms, load_ms))}


def default_transport(targets: Targets) -> str:
    """Without ``ttft_transport``: what the target offers (a cluster's clients choose per member)."""
    return "direct" if targets.direct is not None else "auto" if targets.cluster is not None else "tcp"


def build_model(job: JobOptions):
    """(model, model id) — the built-in random Llama, or a local checkpoint."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    config = builtin_config(job.model)
    if config is None:  # the option parser let only a directory through
        try:
            model = AutoModelForCausalLM.from_pretrained(job.model, local_files_only=True)
        except (OSError, ValueError) as e:
            raise UsageError(f"model={job.model}: cannot load a local checkpoint directory: {e}") from None
        return model.eval(), f"local:{job.model}"
    torch.manual_seed(RANDOM_LLAMA_SEED)
    model = LlamaForCausalLM(LlamaConfig(**config)).eval()
    name = job.model or "random-llama"
    fingerprint = hashlib.blake2b(repr(sorted(config.items())).encode(), digest_size=6).hexdigest()
    return model, f"kvperf/{name}@seed{RANDOM_LLAMA_SEED}-{fingerprint}"


class TtftBench:
    def __init__(self, job: JobOptions, targets: Targets, token: str | None, progress):
        import torch

        self.torch = torch
        self.job = job
        self.progress = progress
        self.device = job.ttft_device
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise UsageError(f"ttft_device={self.device}: torch sees no CUDA device here")
        model, self.model_id = build_model(job)
        self.model = model.to(self.device)
        params = inspect.signature(self.model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"  # renamed in transformers 5.24
        self.vocab = int(self.model.config.get_text_config(decoder=True).vocab_size)
        self.prefix_tokens = (job.cached_tokens // job.block_tokens) * job.block_tokens
        self.targets_cluster = targets.cluster is not None
        self.transport = job.ttft_transport or default_transport(targets)
        self.nixl_ready: bool | None = None  # None: this transport does not use NIXL
        self.cache = self._open_cache(targets, token)
        self.prompts = self._prompts(max([job.ttft_prompts, *job.concurrency]))
        self.prompt_token_lists = [ids[0].tolist() for ids in self.prompts]
        self.prefix_kv: list = []
        self.verify_errors = 0
        self.verify_messages: list[str] = []
        self.logits_diff_max = 0.0

    def _open_cache(self, targets: Targets, token: str | None):
        from kvtier.client import BlockClient, ClientError
        from kvtier.client.cluster_members import ClusterUnavailable
        from kvtier.client.engines.transformers import namespace_for
        from kvtier.client.kvcache import KVCache

        codec = "raw" if self.job.codec == "opaque" else self.job.codec
        ns = namespace_for(self.model, self.model_id, self.job.block_tokens, codec=codec,
                           tenant_salt=f"kvperf:{self.job.keyspace}:{self.job.seed}",
                           layer_groups=self.job.layer_groups)
        transport = self.transport
        device_map = None
        try:
            if targets.cluster is not None:  # the members from etcd, 2 replicas each, as engines route
                cache = KVCache(ns, targets.cluster.text, token=token, hot_pool_bytes=0, device=self.device,
                                transport=transport)
            else:
                addrs = [t.addr for t in targets.tcp]
                if targets.direct is not None and transport in ("direct", "auto"):
                    with BlockClient(addrs[0], token=token) as c:
                        device_map = targets.direct.for_devices(tuple(c.geometry().device_ids))
                cache = KVCache(ns, addrs, token=token, hot_pool_bytes=0, device=self.device,
                                device_map=device_map, transport=transport)
        except (OSError, ClientError, ClusterUnavailable) as e:  # the client's errors name the problem
            raise ConnectError(f"cannot use target {self.job.target}: {type(e).__name__}: {e}") from e
        except ValueError as e:  # transport=nixl where this host or the daemon lacks NIXL, direct without devices
            raise UsageError(f"ttft_transport={transport}: {e}") from None
        if transport in ("nixl", "auto"):  # set up in the background: the timed loads wait for it
            self.nixl_ready = cache.wait_nixl_ready(NIXL_READY_TIMEOUT_S)
        return cache

    def _prompts(self, count: int) -> list:
        rng = np.random.default_rng([self.job.seed, 0x77])
        return [self.torch.from_numpy(rng.integers(0, self.vocab, (1, self.job.prompt_tokens)).astype(np.int64))
                .to(self.device) for _ in range(count)]

    def setup(self) -> None:
        """Store every prompt's prefix in kvtier; keep its KV in memory for the ideal mode."""
        from kvtier.client.engines.transformers import layers_of_cache

        torch = self.torch
        for ids in self.prompts:
            prefix = ids[:, :self.prefix_tokens]
            with torch.inference_mode():
                out = self.model(prefix, use_cache=True, logits_to_keep=1)
            cache = out.cache if hasattr(out, "cache") else out.past_key_values
            layers = [(k.clone(), v.clone()) for k, v in layers_of_cache(cache)]
            self.cache.store(prefix[0].tolist(), layers, durable=self.job.durable)
            self.prefix_kv.append(layers)
        self.cache.flush()  # sealed on the devices: what direct reads need, the same blocks for every transport

    def _one(self, mode: str, i: int) -> float:
        """TTFT of prompt ``i`` in ``mode``, in ms (what is outside the timer: only test bookkeeping)."""
        from kvtier.client.engines.transformers import cache_from_layers, prefill

        torch = self.torch
        ids = self.prompts[i]
        if mode == "recompute":
            t0 = time.perf_counter()
            with torch.inference_mode():
                out = self.model(ids, use_cache=True, logits_to_keep=1)
            self._sync(out.logits)
            return (time.perf_counter() - t0) * 1e3
        if mode == "inmemory":
            cache = cache_from_layers([(k.clone(), v.clone()) for k, v in self.prefix_kv[i]])
            self._sync(None)
            t0 = time.perf_counter()
            with torch.inference_mode():
                out = self.model(ids[:, self.prefix_tokens:], use_cache=True, logits_to_keep=1,
                                 **{self._cache_arg: cache})
            self._sync(out.logits)
            elapsed = (time.perf_counter() - t0) * 1e3
            self._ideal_logits[i] = out.logits[:, -1]
            return elapsed
        if mode == "load":
            tokens = self.prompt_token_lists[i]
            t0 = time.perf_counter()
            loaded = self.cache.load(tokens, max_tokens=len(tokens) - 1)
            layers = list(loaded.layers)
            self._sync(None)
            elapsed = (time.perf_counter() - t0) * 1e3
            self._check_load(i, loaded.num_tokens, layers)
            return elapsed
        t0 = time.perf_counter()
        result = prefill(self.model, ids, self.cache, store=False)
        self._sync(result.logits)
        elapsed = (time.perf_counter() - t0) * 1e3
        self._check(i, result)
        return elapsed

    def _sync(self, _tensor) -> None:
        """On a GPU, the first token exists when its kernels finished, not when they were queued."""
        if self.device.startswith("cuda"):
            self.torch.cuda.synchronize()

    def _check_tokens(self, i: int, mode: str, loaded_tokens: int) -> None:
        if loaded_tokens != self.prefix_tokens:
            self._verify_error(f"prompt {i}: {mode} loaded {loaded_tokens} of the {self.prefix_tokens} "
                               "stored tokens (a miss of blocks this run stored)")

    def _check_load(self, i: int, loaded_tokens: int, layers: list) -> None:
        self._check_tokens(i, "load", loaded_tokens)
        if not (self.job.verify and self.cache.namespace.codec == "raw") or loaded_tokens != self.prefix_tokens:
            return
        torch = self.torch
        for n, ((k, v), (k0, v0)) in enumerate(zip(layers, self.prefix_kv[i], strict=True)):
            if not (torch.equal(k, k0) and torch.equal(v, v0)):
                self._verify_error(f"prompt {i}: layer {n} of the KV loaded alone differs from the KV stored")
                return

    def _check(self, i: int, result) -> None:
        self._check_tokens(i, "kvtier", result.loaded_tokens)
        ideal = self._ideal_logits.get(i)
        if ideal is None:
            return
        diff = float((result.logits - ideal).abs().max())
        self.logits_diff_max = max(self.logits_diff_max, diff)
        if self.job.verify and self.cache.namespace.codec == "raw" and diff != 0.0:
            self._verify_error(f"prompt {i}: kvtier logits differ from the in-memory ones by {diff:g}")

    def _verify_error(self, message: str) -> None:
        self.verify_errors += 1
        if len(self.verify_messages) < 10:
            self.verify_messages.append(message)

    def level(self, concurrency: int) -> dict:
        count = max(self.job.ttft_prompts, concurrency)
        out: dict = {"concurrency": concurrency, "prompts": count}
        samples: dict = {mode: [] for mode in MODES}
        walls: dict = {mode: 0.0 for mode in MODES}
        if concurrency == 1:  # the modes of one prompt back to back: a drift of the machine moves them alike
            for i in range(count):
                for mode in MODES:
                    t0 = time.perf_counter()
                    samples[mode].append(self._one(mode, i))
                    walls[mode] += time.perf_counter() - t0
                self.progress(len(MODES))
        else:
            for mode in MODES:
                with ThreadPoolExecutor(max_workers=concurrency) as pool:
                    t0 = time.perf_counter()
                    samples[mode] = list(pool.map(lambda i, m=mode: self._one(m, i), range(count)))
                    walls[mode] = time.perf_counter() - t0
                self.progress(count)
        for mode in MODES:
            ttfts = samples[mode]
            out[mode] = {"ttft_ms_mean": float(np.mean(ttfts)),
                         "ttft_ms_p99": float(np.percentile(ttfts, 99, method="inverted_cdf")),
                         "prompts_per_s": count / walls[mode]}
        out["throughput_gain"] = out["kvtier"]["prompts_per_s"] / out["recompute"]["prompts_per_s"] - 1.0
        out["ttft_reduction"] = 1.0 - out["kvtier"]["ttft_ms_mean"] / out["recompute"]["ttft_ms_mean"]
        out.update(load_figures(*(out[m]["ttft_ms_mean"] for m in ("inmemory", "load", "kvtier"))))
        return out, samples

    def run(self) -> dict:
        self._ideal_logits: dict = {}
        self.setup()
        for mode in MODES:  # warm-up, untimed
            for i in range(WARMUP_PROMPTS):
                self._one(mode, i)
        untimed = self._warm_transports()
        levels, all_samples = [], {m: [] for m in MODES}
        for c in self.job.concurrency:
            lv, samples = self.level(c)
            levels.append(lv)
            for m in MODES:
                all_samples[m] += samples[m]
        stats = {f"{m}_ms": ms_stats(all_samples[m]) for m in MODES}
        rec, mem, load, kv = (stats[f"{m}_ms"]["mean"] for m in MODES)
        warm = self.cache.statistics().as_dict().get("warm", {})
        timed = {name: n - untimed.get(name, 0) for name, n in self._warm_transports().items()
                 if n - untimed.get(name, 0)}
        return {
            "model": self.model_id,
            "prompt_tokens": self.job.prompt_tokens,
            "cached_tokens": self.prefix_tokens,
            "codec": self.cache.namespace.codec,
            "transport": self.transport,
            "nixl_ready": self.nixl_ready,
            "transports": timed,
            **stats,
            "reduction": 1.0 - kv / rec if rec else 0.0,
            "overhead_vs_inmemory": kv / mem - 1.0 if mem else 0.0,
            **load_figures(mem, load, kv),
            "by_concurrency": levels,
            "logits_max_abs_diff": self.logits_diff_max,
            "warm_tier": warm,
            **({"cluster": self.cache.cluster_statistics().as_dict()} if self.targets_cluster else {}),
        }

    def _warm_transports(self) -> dict[str, int]:
        """Blocks the daemons served this cache so far, by the transport that carried them."""
        return dict(self.cache.statistics().warm.transports)

    def close(self) -> None:
        self.cache.close()


def run_ttft(job: JobOptions, targets: Targets, token: str | None, progress) -> tuple[dict, int, list[str], int]:
    """(ttft report, verify errors, their first messages, runtime in ns)."""
    try:
        import torch
        import transformers  # noqa: F401
    except ImportError as e:
        raise UsageError(f"rw=ttft needs torch and transformers ({e}); install kvtier[torch]") from None
    from kvtier.client import ClientError

    threads = torch.get_num_threads()
    if job.ttft_threads:
        torch.set_num_threads(job.ttft_threads)
    t0 = time.perf_counter_ns()
    try:
        bench = TtftBench(job, targets, token, progress)
        try:
            report = bench.run()
        except ClientError as e:
            raise ConnectError(f"the daemon failed the ttft run: {type(e).__name__}: {e}") from e
        finally:
            bench.close()
        report["torch_threads"] = torch.get_num_threads()
    finally:
        torch.set_num_threads(threads)  # the next job of this run starts from the default again
    return report, bench.verify_errors, bench.verify_messages, time.perf_counter_ns() - t0
