"""Prompt normalization before tokenization, so that versions of a system prompt that
differ only in layout share one KV prefix.

Block keys chain over exact tokens (:mod:`kvtier.common.keys`): a system prompt saved
with CRLF line endings, or stamped ``Version: 2.3`` instead of ``Version: 2.4``, has
other tokens, other keys, and misses the cache. The rules below map such versions to one
text. They are deterministic (no locale, no clock, no randomness), idempotent
(``normalize(normalize(x)) == normalize(x)``), and they never merge two texts whose
content differs: they remove only whitespace layout, canonically equivalent Unicode
spellings, and the markers an operator configured. The only way two different contents
map to one text is an explicit entry in the registry of canonical prompts.

Every message (rules 1-5, in this order)::

    1. a leading byte order mark (U+FEFF) is removed
    2. line endings: CRLF and a lone CR become LF (other Unicode separators are content)
    3. Unicode NFC: canonically equivalent spellings ("e" + U+0301 and "é") become one.
       Not NFKC: compatibility folding ("ﬁ" -> "fi", "²" -> "2") changes content.
    4. trailing whitespace of every line is removed: tab, vertical tab, form feed and the
       Unicode space separators (category Zs: space, no-break space, ideographic space...).
       Leading indentation and spaces inside a line are content and stay.
    5. a run of blank lines longer than ``blank_lines_max`` (default 1) is shortened to it

System prompts (role in ``system_roles``) also get, before rule 4:

    M. every match of each configured marker pattern is removed (``marker_patterns``,
       compiled with re.MULTILINE; examples in COMMON_MARKER_PATTERNS)

and after rule 5:

    E. leading and trailing whitespace and blank lines of the whole prompt are removed
       (other messages too with ``strip_message_edges``)

The rules repeat until the text no longer changes (removing a marker can leave a blank
line, or bring a base letter next to a combining mark), which is what makes the result
idempotent. Last, a system prompt whose normalized text is registered (as a canonical
prompt or as a variant of one) becomes the canonical text.
"""
from __future__ import annotations

import re
import threading
import unicodedata
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from prompt_registry import CanonicalPromptRegistry, prompt_digest

TEXT_CHARS_MAX = 16 * 2**20  # about 4 M tokens, beyond any context window: bounds the work per message
MARKER_PATTERNS_MAX = 64  # each pattern is a pass over every system prompt
MARKER_PATTERN_CHARS_MAX = 1000  # a marker is a short stamp, not a grammar
MESSAGES_MAX = 10_000  # one chat request's messages

# Rule 4's whitespace: tab, vertical tab, form feed and the Unicode space separators
# (category Zs, listed here rather than scanned for at import; a test checks the list).
UNICODE_SPACE_SEPARATORS = " \u00a0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009\u200a\u202f\u205f\u3000"
LINE_WHITESPACE = "\t\v\f" + UNICODE_SPACE_SEPARATORS
_EDGE_WHITESPACE = LINE_WHITESPACE + "\n"
_BOM = "\ufeff"

# Markers seen in the field: a starting point for marker_patterns. A marker on a line of
# its own takes its line ending with it, so the prompt reads as if it had never been there.
COMMON_MARKER_PATTERNS = (
    r"(?i)^[ \t]*version[ \t]*:?[ \t]*v?\d+(?:\.\d+)*[ \t]*$\n?",  # "Version: 2.3"
    r"[ \t]*<!--[ \t]*v(?:ersion)?[ \t]*[\d.]+[ \t]*-->",  # "<!-- v12 -->", anywhere in a line
    r"(?i)^[ \t]*last[ \t]+updated[ \t]*:[ \t]*\d{4}-\d{2}-\d{2}(?:[ T]\d{2}:\d{2}(?::\d{2})?)?[ \t]*$\n?",
)


@dataclass(frozen=True)
class NormalizeConfig:
    """Which rules apply (see the module doc); the defaults are rules 1-5 and E, no markers."""

    remove_leading_bom: bool = True
    unify_line_endings: bool = True
    unicode_nfc: bool = True
    strip_trailing_whitespace: bool = True
    blank_lines_max: int | None = 1  # None keeps every blank line
    system_roles: tuple[str, ...] = ("system",)
    marker_patterns: tuple[str, ...] = ()
    strip_system_edges: bool = True
    strip_message_edges: bool = False

    def __post_init__(self) -> None:
        for name in ("remove_leading_bom", "unify_line_endings", "unicode_nfc", "strip_trailing_whitespace",
                     "strip_system_edges", "strip_message_edges"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"NormalizeConfig.{name} must be a bool, got {getattr(self, name)!r}")
        limit = self.blank_lines_max
        if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 0):
            raise ValueError(f"NormalizeConfig.blank_lines_max must be None or an int >= 0, got {limit!r}")
        object.__setattr__(self, "system_roles", tuple(self.system_roles))
        if not all(isinstance(r, str) and r for r in self.system_roles):
            raise ValueError(f"NormalizeConfig.system_roles must be non-empty strings, got {self.system_roles!r}")
        object.__setattr__(self, "marker_patterns", tuple(self.marker_patterns))
        if len(self.marker_patterns) > MARKER_PATTERNS_MAX:
            raise ValueError(f"{len(self.marker_patterns)} marker patterns is over the limit {MARKER_PATTERNS_MAX}")
        for pattern in self.marker_patterns:
            _compile_marker(pattern)

    def compiled_markers(self) -> tuple[re.Pattern[str], ...]:
        return tuple(_compile_marker(p) for p in self.marker_patterns)


def _compile_marker(pattern: object) -> re.Pattern[str]:
    if not isinstance(pattern, str) or not pattern:
        raise ValueError(f"a marker pattern must be a non-empty string, got {pattern!r}")
    if len(pattern) > MARKER_PATTERN_CHARS_MAX:
        raise ValueError(f"marker pattern of {len(pattern)} characters is over the limit {MARKER_PATTERN_CHARS_MAX}")
    try:
        compiled = re.compile(pattern, re.MULTILINE)
    except re.error as exc:
        raise ValueError(f"marker pattern {pattern!r} is not a valid regular expression: {exc}") from None
    if compiled.fullmatch(""):
        raise ValueError(f"marker pattern {pattern!r} matches the empty string: it would mark nothing")
    return compiled


@dataclass(frozen=True)
class NormalizerStatistics:
    system_prompts: int  # system prompts normalized
    texts: int  # texts of every role normalized (system prompts included; each text part of a message counts)
    texts_changed: int  # texts that a rule changed
    markers_removed: int  # marker matches removed from system prompts
    canonical_mapped: int  # system prompts replaced by a different registered canonical text
    canonical_prompts: int
    variants: int


class Normalizer:
    """Applies a :class:`NormalizeConfig` to system prompts and chat messages, and maps
    system prompts to their registered canonical texts. Safe to share between threads."""

    def __init__(self, config: NormalizeConfig | None = None) -> None:
        self.config = config if config is not None else NormalizeConfig()
        self._markers = self.config.compiled_markers()
        self._registry = CanonicalPromptRegistry()
        self._lock = threading.Lock()
        self._system = self._texts = self._changed = self._markers_removed = self._mapped = 0

    # -- the rules ---------------------------------------------------------------
    def _one_pass(self, text: str, system: bool) -> tuple[str, int]:
        cfg = self.config
        if cfg.remove_leading_bom:
            text = text.removeprefix(_BOM)
        if cfg.unify_line_endings:
            text = text.replace("\r\n", "\n").replace("\r", "\n")
        if cfg.unicode_nfc and not unicodedata.is_normalized("NFC", text):
            text = unicodedata.normalize("NFC", text)
        removed = 0
        if system:
            for marker in self._markers:
                text, n = marker.subn("", text)
                removed += n
        lines = text.split("\n")
        if cfg.strip_trailing_whitespace:
            lines = [line.rstrip(LINE_WHITESPACE) for line in lines]
        if cfg.blank_lines_max is not None:
            lines = _collapse_blank_lines(lines, cfg.blank_lines_max)
        text = "\n".join(lines)
        if cfg.strip_message_edges or (system and cfg.strip_system_edges):
            text = text.strip(_EDGE_WHITESPACE)
        return text, removed

    def _apply(self, text: str, system: bool) -> tuple[str, int]:
        """The rules, repeated to a fixed point; returns the text and the markers removed.
        After the first pass a pass only deletes characters or recomposes them (NFC of
        NFC text is itself), so the loop ends within a pass or two per deletion."""
        _check_text(text)
        removed = 0
        passes_max = 2 * len(text) + 4
        for _ in range(passes_max):
            result, n = self._one_pass(text, system)
            removed += n
            if result == text:
                return result, removed
            text = result
        raise AssertionError(f"normalization did not reach a fixed point in {passes_max} passes")

    def _normalize_counted(self, text: str, system: bool) -> str:
        result, removed = self._apply(text, system)
        mapped = False
        if system:
            with self._lock:
                found = self._registry.canonical_of(result)
            if found is not None and found[1] != result:
                result, mapped = found[1], True
        with self._lock:
            self._texts += 1
            self._system += system
            self._changed += result != text
            self._markers_removed += removed
            self._mapped += mapped
        return result

    # -- the API -----------------------------------------------------------------
    def normalize_system(self, text: str) -> str:
        """A system prompt: every rule, markers and edges included, then the canonical text
        if the result is registered."""
        return self._normalize_counted(text, system=True)

    def normalize_text(self, text: str) -> str:
        """A message of any other role: rules 1-5 (and E with ``strip_message_edges``)."""
        return self._normalize_counted(text, system=False)

    def normalize_messages(self, messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """Chat messages (``{"role", "content", ...}``), as new dicts: system roles get the
        system rules, every other role rules 1-5. ``content`` may be a string or a list of
        parts, whose ``{"type": "text", "text": ...}`` parts are normalized; other parts and
        keys are passed through untouched. The input is not modified."""
        if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)):
            raise ValueError(f"messages must be a list of dicts, got {type(messages).__name__}")
        if len(messages) > MESSAGES_MAX:
            raise ValueError(f"{len(messages)} messages is over the limit {MESSAGES_MAX}")
        for i, message in enumerate(messages):  # all checked before any is normalized or counted
            _check_message(i, message)
            for text in _texts_of(message.get("content")):
                _check_text(text)
        out = []
        for message in messages:
            copy = dict(message)
            copy["content"] = self._content(message.get("content"), message["role"] in self.config.system_roles)
            out.append(copy)
        return out

    def _content(self, content: Any, system: bool) -> Any:
        if isinstance(content, str):
            return self._normalize_counted(content, system)
        if isinstance(content, list):
            return [dict(part, text=self._normalize_counted(part["text"], system)) if _is_text_part(part) else part
                    for part in content]
        return content

    def register_canonical(self, text: str, variants: Sequence[str] = ()) -> str:
        """Register the canonical system prompt ``text`` (normalized first) and optional
        variants of it, all or none; returns its id, the digest of its normalized text."""
        canonical, _ = self._apply(text, system=True)
        normalized_variants = tuple(self._apply(v, system=True)[0] for v in variants)
        with self._lock:
            return self._registry.add_canonical(canonical, normalized_variants)

    def register_variant(self, text: str, canonical_id: str) -> str:
        """Map the system prompt ``text`` (normalized first) to a registered canonical prompt."""
        variant, _ = self._apply(text, system=True)
        with self._lock:
            return self._registry.add_variant(variant, canonical_id)

    def system_prompt_id(self, text: str) -> str:
        """The digest naming a system prompt after normalization (and canonical mapping)."""
        result, _ = self._apply(text, system=True)
        with self._lock:
            found = self._registry.canonical_of(result)
        return found[0] if found is not None else prompt_digest(result)

    def statistics(self) -> NormalizerStatistics:
        with self._lock:
            registry = self._registry.statistics()
            return NormalizerStatistics(self._system, self._texts, self._changed, self._markers_removed,
                                        self._mapped, registry.canonical_prompts, registry.variants)


def _collapse_blank_lines(lines: list[str], keep: int) -> list[str]:
    out: list[str] = []
    run = 0
    for line in lines:
        run = run + 1 if not line else 0
        if run <= keep:
            out.append(line)
    return out


def _check_text(text: object) -> None:
    if not isinstance(text, str):
        raise ValueError(f"a prompt must be a str, got {type(text).__name__}")
    if len(text) > TEXT_CHARS_MAX:
        raise ValueError(f"a prompt of {len(text)} characters is over the limit {TEXT_CHARS_MAX}")


def _check_message(index: int, message: object) -> None:
    if not isinstance(message, Mapping):
        raise ValueError(f"message {index} must be a dict, got {type(message).__name__}")
    role = message.get("role")
    if not isinstance(role, str):
        raise ValueError(f"message {index} has no string 'role' (got {role!r})")
    content = message.get("content")
    if content is not None and not isinstance(content, (str, list)):
        raise ValueError(f"message {index} content must be a string, a list of parts or None, "
                         f"got {type(content).__name__}")


def _is_text_part(part: object) -> bool:
    return isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str)


def _texts_of(content: Any) -> list[str]:
    if isinstance(content, str):
        return [content]
    if isinstance(content, list):
        return [part["text"] for part in content if _is_text_part(part)]
    return []
