"""The ttft workload's built-in models, and the check of a ``model=`` value.

Each built-in model is a random-weight transformers Llama built from a
``LlamaConfig`` in code (no download, no hub); the shapes live here so that the
option parser can name them without importing torch::

    name                    layers  hidden  MLP   heads / KV heads x dim  KV per token (fp32)
    random-llama (default)       6     512  1536        8 / 4 x 64              12 KiB
    random-llama-kvheavy        32     256   512        4 / 4 x 64              64 KiB
    random-llama-tiny            2     128   256        4 / 2 x 32               1 KiB

``random-llama-kvheavy`` carries about 5x the KV per token of ``random-llama``
at a sixth of its MLP weights per layer (every head its own KV head, a small
hidden size, as many layers as Llama-3-8B): even on a CPU the load of a stored
prefix is a large share of the in-memory TTFT (on a GPU it is most of it), and
a layer-pipelined load has layers to overlap. ``perf/jobs/ttft-kvheavy.fio``
gates that share (``ttft.load_vs_inmemory``).
Any other value must be a local checkpoint directory.
"""
from __future__ import annotations

import os

from .units import UsageError

RANDOM_LLAMA = dict(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=6,
                    num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=8192)
RANDOM_LLAMA_KVHEAVY = dict(vocab_size=8192, hidden_size=256, intermediate_size=512, num_hidden_layers=32,
                            num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=8192)
RANDOM_LLAMA_TINY = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
BUILTIN_MODELS = {"random-llama": RANDOM_LLAMA, "random-llama-kvheavy": RANDOM_LLAMA_KVHEAVY,
                  "random-llama-tiny": RANDOM_LLAMA_TINY}
DEFAULT_MODEL = "random-llama"


def builtin_config(name: str) -> dict | None:
    """The LlamaConfig fields of a built-in model ("" is the default), or None."""
    return BUILTIN_MODELS.get(name or DEFAULT_MODEL)


def parse_model(option: str, text: str) -> str:
    """A built-in model's name, "" (the default) or an existing directory; the
    hub is never asked, so anything else is an error that says what is accepted."""
    if text == "" or text in BUILTIN_MODELS or os.path.isdir(text):
        return text
    raise UsageError(f"{option}={text!r}: not a built-in model ({', '.join(BUILTIN_MODELS)}) and not a "
                     "directory; a path must be a local checkpoint directory (kvperf never downloads from "
                     "the model hub)")
