"""The request trace of ``perf/bench_cdn.py``: chat requests over shared system prompts in
several spellings, Zipf-popular documents and a unique user turn, and the toy tokenizer
that turns them into tokens. Pure: no I/O, deterministic for a seed.

    request = system prompt (one of ``apps``, Zipf; in one of its VERSIONS, uniform)
              + document (one of ``documents``, Zipf)
              + the user's own question (unique)

The versions of one system prompt differ only in layout and markers (line endings,
trailing spaces, a ``Version:`` line, a ``Last updated:`` date line, an HTML version
comment), which is what ``prompt_normalize`` with ``COMMON_MARKER_PATTERNS``
removes: normalized, every version of a prompt is one text, and one chain of keys.
"""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

import numpy as np

VOCAB = 32000  # token ids, as a Llama vocabulary
TOKEN_RE = re.compile(r"\w+|[^\w\s]|\s+")  # words, punctuation, whitespace runs: layout changes the tokens
WORDS = ("the assistant answers questions about the document below briefly and cites the section it used "
         "never invent facts say when the document does not say refuse unsafe requests keep a polite tone "
         "use metric units format code in blocks summarize long passages list steps in order ask for "
         "clarification when a request is ambiguous prefer plain words avoid jargon explain acronyms").split()


def version_texts(base: str, app: int) -> tuple[str, ...]:
    """The spellings of one system prompt that reach the engine from different services."""
    lines = base.split("\n")
    middle = len(lines) // 2
    return (
        base,                                                              # the canonical text
        base.replace("\n", "\r\n"),                                        # saved on Windows
        "\n".join(line + "  " for line in lines),                          # trailing spaces
        "\n".join(lines[:middle] + [f"Version: 2.{app}"] + lines[middle:]),  # a version stamp
        f"Last updated: 2026-11-{10 + app:02d}\n" + base,                  # a date line first
        base + f" <!-- v{12 + app} -->",                                    # a version comment
    )


VERSIONS = len(version_texts("a\nb", 0))


def tokenize(text: str) -> list[int]:
    """Each word, punctuation mark and whitespace run is one token, its id a stable hash."""
    return [int.from_bytes(hashlib.blake2b(piece.encode(), digest_size=4).digest(), "little") % VOCAB
            for piece in TOKEN_RE.findall(text)]


def render(messages: list[dict]) -> str:
    """A chat template: each message as a role tag line, then its content."""
    return "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages)


@dataclass(frozen=True)
class Request:
    index: int
    user: int
    app: int
    version: int
    document: int
    messages: tuple  # ({"role", "content"}, ...)

    @property
    def question_marker(self) -> str:
        """Where the user's own question starts in the rendered prompt."""
        return f"Question {self.index} from user {self.user}:"


@dataclass(frozen=True)
class TraceConfig:
    requests: int = 10_000
    apps: int = 6  # distinct system prompts
    documents: int = 400
    users: int = 2_000
    zipf_s: float = 1.1  # the exponent of the apps' and the documents' popularity
    system_lines: int = 8  # lines of a system prompt, ~14 words each
    document_words: int = 30
    question_words: int = 12
    seed: int = 16

    def __post_init__(self) -> None:
        for name in ("requests", "apps", "documents", "users", "system_lines", "document_words", "question_words"):
            if getattr(self, name) < 1:
                raise ValueError(f"TraceConfig.{name} must be 1 or more, got {getattr(self, name)}")
        if self.zipf_s <= 0:
            raise ValueError(f"TraceConfig.zipf_s must be positive, got {self.zipf_s}")


def _words(rng: np.random.Generator, n: int) -> str:
    return " ".join(WORDS[i] for i in rng.integers(0, len(WORDS), n))


def _zipf_choice(rng: np.random.Generator, n: int, s: float, size: int) -> np.ndarray:
    weights = 1.0 / np.arange(1, n + 1) ** s
    return rng.choice(n, size=size, p=weights / weights.sum())


def build_trace(cfg: TraceConfig) -> list[Request]:
    rng = np.random.default_rng(cfg.seed)
    systems = ["\n".join(_words(rng, 14) + "." for _ in range(cfg.system_lines)) for _ in range(cfg.apps)]
    versions = [version_texts(text, a) for a, text in enumerate(systems)]
    documents = [f"Document {d}: " + _words(rng, cfg.document_words) + "." for d in range(cfg.documents)]
    apps = _zipf_choice(rng, cfg.apps, cfg.zipf_s, cfg.requests)
    docs = _zipf_choice(rng, cfg.documents, cfg.zipf_s, cfg.requests)
    spellings = rng.integers(0, VERSIONS, cfg.requests)
    users = rng.integers(0, cfg.users, cfg.requests)
    out = []
    for i in range(cfg.requests):
        question = f"Question {i} from user {users[i]}: " + _words(rng, cfg.question_words) + "?"
        messages = ({"role": "system", "content": versions[apps[i]][spellings[i]]},
                    {"role": "user", "content": documents[docs[i]] + "\n\n" + question})
        out.append(Request(i, int(users[i]), int(apps[i]), int(spellings[i]), int(docs[i]), messages))
    return out


def edge_of_user(user: int, edges: int) -> int:
    """A router's session affinity: the edge a user's requests go to, by a hash of the user."""
    return int.from_bytes(hashlib.blake2b(f"user-{user}".encode(), digest_size=8).digest(), "little") % edges


__all__ = ["Request", "TraceConfig", "VERSIONS", "build_trace", "edge_of_user", "render", "tokenize",
           "version_texts"]
