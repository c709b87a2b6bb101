"""The kvperf options: one table of names, parsers, defaults and help, and the
frozen :class:`JobOptions` a job runs with.

Every option works in a job file (``bs=2m``) and on the command line
(``--bs=2m``); an unknown option or a bad value is a :class:`UsageError` that
names the job, where it came from, and what is wrong.
"""
from __future__ import annotations

import difflib
import re
from dataclasses import MISSING, dataclass, fields
from typing import Callable

from kvtier.common.codec_ids import codec_id

from .ioengines import IOENGINES
from .jobfile import NAME_OPTION, RawJob
from .models import BUILTIN_MODELS, parse_model
from .units import (UsageError, parse_bool, parse_float, parse_int, parse_int_list,
                    parse_time_s)

IODEPTH_MAX = 1024  # outstanding requests per clone; more only queues in the client
NUMJOBS_MAX = 64  # clones are processes; more than the cores of a big host is noise
BLOCK_BYTES_MAX = 256 << 20  # a block must fit a daemon region (64 MiB default, 256 MiB at most)
BATCH_MAX = 1024  # blocks per request; the protocol's batch limit is of this order
LOOKUP_KEYS_MAX = 65536  # keys per LOOKUP chain
PROMPT_TOKENS_MAX = 1 << 20  # a synthetic prompt longer than a million tokens is a typo

RW_BLOCK = ("read", "write", "randread", "randwrite", "rw", "readwrite", "randrw")
RW_MODES = RW_BLOCK + ("lookup", "prefix", "ttft")
TTFT_TRANSPORTS = ("tcp", "direct", "nixl", "auto")  # kvtier.client.kvcache.TRANSPORTS


def _codec(option: str, text: str) -> str:
    if text == "opaque":
        return text
    try:
        codec_id(text)
    except ValueError as e:
        raise UsageError(f"{option}={text!r}: {e}") from None
    return text


def _rw(option: str, text: str) -> str:
    if text not in RW_MODES:
        raise UsageError(f"{option}={text!r}: unknown workload; choose one of {', '.join(RW_MODES)}")
    return "rw" if text == "readwrite" else text


def _ioengine(option: str, text: str) -> str:
    if text not in IOENGINES:
        raise UsageError(f"{option}={text!r}: choose one of {', '.join(IOENGINES)}")
    return text


def _verify(option: str, text: str) -> bool:
    # fio names a method (crc32c, md5, pattern, ...); kvperf has one: content derived from the key.
    if text.lower() in ("crc32c", "crc32c-intel", "md5", "sha256", "pattern", "meta", "xxhash"):
        return True
    return parse_bool(option, text)


def _distribution(option: str, text: str) -> float:
    """``zipf:1.1`` -> 1.1 (the skew); ``random`` -> 0 (uniform)."""
    if text == "random":
        return 0.0
    kind, _, theta = text.partition(":")
    if kind != "zipf" or not theta:
        raise UsageError(f"{option}={text!r}: use zipf:THETA (e.g. zipf:1.1) or random")
    return parse_float(option, theta, minimum=0.0, maximum=10.0)


def _device(option: str, text: str) -> str:
    if text != "cpu" and not re.fullmatch(r"cuda(:[0-9]+)?", text):
        raise UsageError(f"{option}={text!r}: use cpu, cuda or cuda:N")
    return text


def _ttft_transport(option: str, text: str) -> str:
    if text not in TTFT_TRANSPORTS:
        raise UsageError(f"{option}={text!r}: unknown transport; choose one of {', '.join(TTFT_TRANSPORTS)}")
    return text


def _text(option: str, text: str) -> str:
    if not text:
        raise UsageError(f"{option}= needs a value")
    return text


def _path_or_empty(option: str, text: str) -> str:
    return text


@dataclass(frozen=True)
class Option:
    name: str
    parse: Callable[[str, str], object]
    help: str
    field: str = ""  # JobOptions field; defaults to name


def _o(name: str, parse, help: str, field_name: str = "") -> Option:
    return Option(name, parse, help, field_name or name)


OPTIONS: dict[str, Option] = {o.name: o for o in (
    _o(NAME_OPTION, _text, "the job's name in the report (default: its section's name); "
       "on the command line --name starts a job"),
    _o("rw", _rw, "workload: " + ", ".join(RW_MODES)),
    _o("readwrite", _rw, "same as rw", "rw"),
    _o("bs", lambda o, t: parse_int(o, t, 1, BLOCK_BYTES_MAX), "block payload size (k/m/g)"),
    _o("iodepth", lambda o, t: parse_int(o, t, 1, IODEPTH_MAX), "requests in flight per clone"),
    _o("numjobs", lambda o, t: parse_int(o, t, 1, NUMJOBS_MAX), "clones of this job, each its own process"),
    _o("size", lambda o, t: parse_int(o, t, 1), "bytes each clone covers (its key space)"),
    _o("runtime", parse_time_s, "stop after this long (s, or us/ms/m/h suffix); 0 = no limit"),
    _o("time_based", parse_bool, "repeat the workload until runtime has passed"),
    _o("ramp_time", parse_time_s, "run this long before recording statistics"),
    _o("target", _text, "tcp://HOST:PORT[,tcp://HOST:PORT...] or direct:DEVMAP@tcp://HOST:PORT"),
    _o("ioengine", _ioengine, "sync (blocking client on iodepth threads, zero copy) or asyncio"),
    _o("token_file", _text, "file holding the daemon's auth token"),
    _o("codec", _codec, "codec id written in block headers (opaque, raw, int8, ...); ttft encodes with it"),
    _o("durable", parse_bool, "ask the daemon to sync each put to flash before acknowledging"),
    _o("verify", _verify, "write content derived from the key and check it on every read"),
    _o("verify_only", parse_bool, "only read and verify what an earlier run wrote"),
    _o("seed", lambda o, t: parse_int(o, t, 0, 2**63 - 1), "seed of keys and random choices"),
    _o("randseed", lambda o, t: parse_int(o, t, 0, 2**63 - 1), "same as seed (fio's name)", "seed"),
    _o("keyspace", _text, "name of the key space; jobs with the same keyspace and seed share keys"),
    _o("rwmixread", lambda o, t: parse_int(o, t, 0, 100), "percent of reads in rw/randrw"),
    _o("batch", lambda o, t: parse_int(o, t, 1, BATCH_MAX), "blocks per request (get_many/put_many)"),
    _o("lookup_keys", lambda o, t: parse_int(o, t, 1, LOOKUP_KEYS_MAX), "keys per LOOKUP chain (rw=lookup)"),
    _o("prompt_tokens", lambda o, t: parse_int(o, t, 1, PROMPT_TOKENS_MAX), "tokens per prompt (prefix, ttft)"),
    _o("block_tokens", lambda o, t: parse_int(o, t, 1, 65536), "tokens per block (prefix)"),
    _o("layer_groups", lambda o, t: parse_int(o, t, 1, 1024),
       "objects per block, one per group of layers, loaded layer group by group (ttft)"),
    _o("prefix_share", lambda o, t: parse_float(o, t, 0.0, 1.0),
       "fraction of each prompt that is shared content: system prompt + document (prefix)"),
    _o("prefix_systems", lambda o, t: parse_int(o, t, 1, 1 << 20), "number of distinct system prompts"),
    _o("prefix_docs", lambda o, t: parse_int(o, t, 0, 1 << 20), "number of distinct shared documents"),
    _o("prefix_requests", lambda o, t: parse_int(o, t, 1, 1 << 30), "requests per clone (prefix)"),
    _o("random_distribution", _distribution, "popularity of shared content: zipf:THETA or random"),
    _o("trace", _text, "JSON-lines trace of token-id lists to replay (prefix)"),
    _o("model", parse_model, f"ttft: a built-in random-weight Llama ({', '.join(BUILTIN_MODELS)}; "
       "random-llama is the default) or a local checkpoint directory"),
    _o("cached_tokens", lambda o, t: parse_int(o, t, 0, PROMPT_TOKENS_MAX), "ttft: tokens of each prompt stored"),
    _o("concurrency", lambda o, t: parse_int_list(o, t, 1), "ttft: concurrency levels, e.g. 1,8,16"),
    _o("ttft_device", _device, "ttft: torch device of the model and the KV (cpu, cuda, cuda:1)"),
    _o("ttft_prompts", lambda o, t: parse_int(o, t, 1, 1 << 16), "ttft: prompts per concurrency level"),
    _o("ttft_threads", lambda o, t: parse_int(o, t, 0, 1 << 10), "ttft: torch threads for the model on the CPU "
       "(0: torch's default, every core); fewer leave cores to the load, as a GPU's compute does"),
    _o("ttft_transport", _ttft_transport, "ttft: how loads reach the daemon: " + ", ".join(TTFT_TRANSPORTS)
       + " (default: direct with a direct: target, auto with a cluster, tcp otherwise)"),
    _o("description", _path_or_empty, "free text shown in the report"),
    _o("stonewall", parse_bool, "accepted for fio compatibility: kvperf always runs jobs one after another"),
    _o("group_reporting", parse_bool, "accepted for fio compatibility: clones are always reported together"),
)}


@dataclass(frozen=True)
class JobOptions:
    """A job's validated settings. Sizes in bytes, times in seconds."""

    name: str
    rw: str = "read"
    bs: int = 2 << 20
    iodepth: int = 1
    numjobs: int = 1
    size: int = 64 << 20
    runtime: float = 0.0
    time_based: bool = False
    ramp_time: float = 0.0
    target: str = ""
    ioengine: str = "sync"
    token_file: str = ""
    codec: str = "opaque"
    durable: bool = False
    verify: bool = False
    verify_only: bool = False
    seed: int = 0x6B767065  # "kvpe"
    keyspace: str = "kvperf"
    rwmixread: int = 50
    batch: int = 1
    lookup_keys: int = 1024
    prompt_tokens: int = 2048
    block_tokens: int = 16
    layer_groups: int = 1
    prefix_share: float = 0.75
    prefix_systems: int = 8
    prefix_docs: int = 64
    prefix_requests: int = 128
    random_distribution: float = 1.1
    trace: str = ""
    model: str = ""
    cached_tokens: int = 1792
    concurrency: tuple[int, ...] = (1, 8, 16)
    ttft_prompts: int = 8
    ttft_threads: int = 0  # 0: torch's default
    ttft_device: str = "cpu"
    ttft_transport: str = ""  # "": from the target (ttftjob.default_transport)
    description: str = ""
    stonewall: bool = False
    group_reporting: bool = False
    gates: tuple[str, ...] = ()
    unused: tuple[str, ...] = ()  # inherited options this workload does not use (a note on stderr)

    @property
    def blocks(self) -> int:
        """Blocks in each clone's key space."""
        return self.size // self.bs

    @property
    def reads(self) -> bool:
        return self.rw in ("read", "randread", "rw", "randrw")

    @property
    def writes(self) -> bool:
        return self.rw in ("write", "randwrite", "rw", "randrw")

    @property
    def random(self) -> bool:
        return self.rw.startswith("rand")

    def as_dict(self) -> dict[str, str]:
        """Options as strings, for the JSON report's ``job options``."""
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "gates":
                continue
            out[f.name] = ",".join(map(str, value)) if isinstance(value, tuple) else str(value)
        return out


# options a workload does not use: set in its own section, an error; inherited ([global], or the
# command line before any --name), a note on stderr (JobOptions.unused)
UNUSED_BY_RW: dict[str, tuple[str, ...]] = {
    "ttft": ("numjobs", "iodepth", "ioengine", "runtime", "time_based", "ramp_time", "bs", "size", "batch",
             "rwmixread"),
    "prefix": ("size", "batch", "rwmixread"),
    "lookup": ("batch", "rwmixread"),
}
UNUSED_REASON = {"ttft": "it runs ttft_prompts prompts at each concurrency= level, in blocks of the model's KV",
                 "prefix": "it sends prefix_requests prompts of prompt_tokens, split at the protocol's request limit",
                 "lookup": "it asks lookup_keys keys a request"}


def _unused(job_rw: str, raw: RawJob) -> tuple[str, ...]:
    """The options of ``raw`` its workload does not use, inherited ones; UsageError for its own."""
    unused = [key for key in UNUSED_BY_RW.get(job_rw, ()) if key in raw.values()]
    own = [key for key in unused if key in raw.own]
    if own:
        one = len(own) == 1
        raise UsageError(f"job {raw.name!r} ({raw.source}): {', '.join(own)} ha{'s' if one else 've'} no effect on "
                         f"rw={job_rw} ({UNUSED_REASON[job_rw]}); remove {'it' if one else 'them'}")
    return tuple(unused)


def _unknown(name: str, raw: RawJob) -> UsageError:
    close = difflib.get_close_matches(name, list(OPTIONS) + ["gate"], n=1)
    hint = f" (did you mean {close[0]}?)" if close else ""
    return UsageError(f"job {raw.name!r} ({raw.source}): unknown option {name!r}{hint}")


def build_job(raw: RawJob) -> JobOptions:
    """Type and validate one job's options."""
    values: dict[str, object] = {"name": raw.name}  # a name= in the section overrides it
    for key, text in raw.values().items():
        opt = OPTIONS.get(key)
        if opt is None:
            raise _unknown(key, raw)
        try:
            values[opt.field] = opt.parse(key, text)
        except UsageError as e:
            raise UsageError(f"job {raw.name!r} ({raw.source}): {e}") from None
    values["gates"] = tuple(raw.repeated("gate"))
    values["unused"] = _unused(str(values.get("rw", "read")), raw)
    job = JobOptions(**values)  # type: ignore[arg-type]
    _check(job, raw)
    return job


def _check(job: JobOptions, raw: RawJob) -> None:
    """Constraints between options."""
    where = f"job {raw.name!r} ({raw.source})"
    if not job.target:
        raise UsageError(f"{where}: no target; give target=tcp://HOST:PORT (or --target=...)")
    if job.rw not in ("prefix", "ttft") and job.size < job.bs * job.batch:
        raise UsageError(f"{where}: size={job.size} is smaller than one request (bs={job.bs} x batch={job.batch})")
    if job.time_based and job.runtime <= 0:
        raise UsageError(f"{where}: time_based needs a runtime")
    if job.runtime and job.ramp_time >= job.runtime:
        raise UsageError(f"{where}: ramp_time ({job.ramp_time}s) must be shorter than runtime ({job.runtime}s)")
    if job.verify_only and job.rw not in ("read", "randread"):
        raise UsageError(f"{where}: verify_only needs rw=read or rw=randread, not {job.rw}")
    if job.verify_only and not job.verify:
        raise UsageError(f"{where}: verify_only needs verify=1 (without it nothing read back is checked, "
                         "and a block that is not there only counts as a miss)")
    if job.rw == "ttft" and job.cached_tokens >= job.prompt_tokens:
        raise UsageError(f"{where}: cached_tokens ({job.cached_tokens}) must be less than prompt_tokens "
                         f"({job.prompt_tokens}): at least one token is prefilled")
    if job.ttft_transport == "direct" and not job.target.startswith("direct:"):
        raise UsageError(f"{where}: ttft_transport=direct needs the daemon's device map: "
                         "target=direct:ID=PATH[,ID=PATH...]@tcp://HOST:PORT")
    if job.rw == "prefix" and job.prompt_tokens < job.block_tokens and not job.trace:
        raise UsageError(f"{where}: prompt_tokens ({job.prompt_tokens}) is shorter than one block "
                         f"(block_tokens={job.block_tokens})")


def build_jobs(raws: list[RawJob]) -> list[JobOptions]:
    return [build_job(r) for r in raws]


def option_help() -> list[tuple[str, str, str]]:
    """(name, default, help) for ``kvperf --cmdhelp``."""
    defaults = {f.name: "" if f.default is MISSING else f.default for f in fields(JobOptions)}
    return [(o.name, str(defaults.get(o.field, "")), o.help) for o in OPTIONS.values()]
