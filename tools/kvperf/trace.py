"""Prompts for the prefix workload: a synthetic chat/RAG trace, or a replay.

Synthetic: every prompt is ``prompt_tokens`` long::

    [ system prompt | shared document | unique user turn ]
      <--- prefix_share * prompt_tokens --->

The system prompt (a quarter of the shared part, all of it when
``prefix_docs=0``) is one of ``prefix_systems``, the document one of
``prefix_docs``, both drawn with Zipf popularity (``random_distribution=
zipf:THETA``: P(rank r) ~ 1/r^THETA; ``random`` is uniform). The user turn
is fresh random tokens, so it never hits. Token ids are drawn from
``VOCAB_SIZE``; the content only matters through the chained keys.

Replay: a JSON-lines file, one prompt per line, either a list of token ids
or an object with a ``"tokens"`` list. Clone ``c`` of ``n`` replays lines
``c, c+n, c+2n, ...``.
"""
from __future__ import annotations

import json
from typing import Iterator

import numpy as np

from .options import JobOptions
from .units import UsageError

VOCAB_SIZE = 32000  # a Llama-sized vocabulary
TRACE_LINES_MAX = 10_000_000  # a replay longer than this is a different benchmark
TRACE_LINE_TOKENS_MAX = 1 << 20  # one prompt of a million tokens at most
SYSTEM_SHARE_OF_SHARED = 0.25  # the system prompt's part of the shared tokens when documents exist


def zipf_probabilities(n: int, theta: float) -> np.ndarray:
    weights = 1.0 / np.arange(1, n + 1, dtype=np.float64) ** theta
    return weights / weights.sum()


class SyntheticTrace:
    def __init__(self, job: JobOptions, clone: int):
        self.job = job
        shared = int(round(job.prompt_tokens * job.prefix_share))
        self.system_tokens = shared if job.prefix_docs == 0 else int(shared * SYSTEM_SHARE_OF_SHARED)
        self.doc_tokens = shared - self.system_tokens
        self.user_tokens = job.prompt_tokens - shared
        # shared content depends on the seed only, so every clone (and run) shares it
        self._systems = self._pieces("system", job.prefix_systems, self.system_tokens)
        self._docs = self._pieces("doc", job.prefix_docs, self.doc_tokens)
        self._p_sys = zipf_probabilities(job.prefix_systems, job.random_distribution)
        self._p_doc = zipf_probabilities(job.prefix_docs, job.random_distribution) if job.prefix_docs else None
        self.rng = np.random.default_rng([job.seed, clone, 1])

    def _pieces(self, kind: str, count: int, tokens: int) -> list[np.ndarray]:
        salt = 1 if kind == "system" else 2
        return [np.random.default_rng([self.job.seed, salt, i]).integers(0, VOCAB_SIZE, tokens, dtype=np.uint32)
                for i in range(count)]

    def prompts(self) -> Iterator[np.ndarray]:
        while True:
            parts = [self._systems[self.rng.choice(len(self._systems), p=self._p_sys)]]
            if self._docs:
                parts.append(self._docs[self.rng.choice(len(self._docs), p=self._p_doc)])
            parts.append(self.rng.integers(0, VOCAB_SIZE, self.user_tokens, dtype=np.uint32))
            yield np.concatenate(parts)


def _parse_line(line: str, where: str) -> np.ndarray:
    try:
        doc = json.loads(line)
    except json.JSONDecodeError as e:
        raise UsageError(f"{where}: not JSON ({e.msg})") from None
    tokens = doc.get("tokens") if isinstance(doc, dict) else doc
    if not isinstance(tokens, list) or not tokens:
        raise UsageError(f"{where}: expected a non-empty list of token ids or {{\"tokens\": [...]}}")
    if len(tokens) > TRACE_LINE_TOKENS_MAX:
        raise UsageError(f"{where}: {len(tokens)} tokens is over the limit {TRACE_LINE_TOKENS_MAX}")
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**32 for t in tokens):
        raise UsageError(f"{where}: token ids must be integers in [0, 2**32)")
    return np.asarray(tokens, dtype=np.uint32)


def replay(path: str, clone: int = 0, clones: int = 1) -> Iterator[np.ndarray]:
    """The prompts of ``path`` that belong to ``clone``; UsageError naming the line at fault."""
    try:
        f = open(path, encoding="utf-8")
    except OSError as e:
        raise UsageError(f"trace {path}: {e.strerror}") from None
    with f:
        n = 0
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            n += 1
            if n > TRACE_LINES_MAX:
                raise UsageError(f"trace {path}: more than {TRACE_LINES_MAX} prompts")
            if (n - 1) % clones == clone:
                yield _parse_line(line, f"trace {path}:{lineno}")


def check_trace(path: str) -> int:
    """Read the whole trace once (before any clone starts); returns its prompt count."""
    count = sum(1 for _ in replay(path))
    if count == 0:
        raise UsageError(f"trace {path} holds no prompts")
    return count
