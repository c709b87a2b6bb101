"""A registry of canonical system prompts, keyed by the digest of their normalized text.

Teams ship a system prompt in several versions that should share one KV prefix (a
typo fixed, a sentence reworded): an operator registers the canonical text and, one by
one, the variants that map to it. Lookup is by the BLAKE2b-128 digest of a variant's
normalized text, confirmed by comparing the text itself, so two prompts share a
canonical text only when one of them was registered as a variant of it by its exact
(normalized) text - never because they look alike::

    digest(normalized variant) --> entry (variant text, canonical id)
    canonical id               --> canonical text

This module holds bookkeeping only: it takes texts that the caller has normalized
(:class:`prompt_normalize.Normalizer` does that before it registers or looks up).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

PROMPT_DIGEST_BYTES = 16  # BLAKE2b-128, as block keys: no accidental collision in any registry size
_PROMPT_PERSON = b"kvtier-prompt-1"
REGISTERED_PROMPTS_MAX = 100_000  # canonical texts and variants together: bounds the registry's memory


def prompt_digest(text: str) -> str:
    """The hex digest that names a (normalized) prompt text."""
    return hashlib.blake2b(text.encode("utf-8"), digest_size=PROMPT_DIGEST_BYTES, person=_PROMPT_PERSON).hexdigest()


@dataclass(frozen=True)
class RegistryStatistics:
    canonical_prompts: int
    variants: int


class CanonicalPromptRegistry:
    """Canonical prompt texts and the variants registered for each (all normalized)."""

    def __init__(self) -> None:
        self._canonical: dict[str, str] = {}  # canonical id -> canonical text
        self._variants: dict[str, tuple[str, str]] = {}  # variant digest -> (variant text, canonical id)

    def __len__(self) -> int:
        return len(self._canonical) + len(self._variants)

    def add_canonical(self, text: str, variants: tuple[str, ...] = ()) -> str:
        """Register ``text`` as a canonical prompt, with optional variants of it; returns its
        id (the digest). All or nothing: a conflict (see :meth:`add_variant`) registers none
        of them. Registering the same texts again changes nothing."""
        digest = prompt_digest(text)
        variant = self._variants.get(digest)
        if variant is not None and variant[0] == text:
            raise ValueError(f"prompt {digest} is already registered as a variant of canonical prompt {variant[1]}")
        new_canonical = digest not in self._canonical
        new_variants: dict[str, str] = {}
        for variant_text in variants:
            variant_digest = prompt_digest(variant_text)
            if variant_digest != digest and self._check_variant(variant_text, variant_digest, digest, new_canonical):
                new_variants[variant_digest] = variant_text
        if len(self) + new_canonical + len(new_variants) > REGISTERED_PROMPTS_MAX:
            raise ValueError(f"the prompt registry is full ({REGISTERED_PROMPTS_MAX} texts)")
        self._canonical[digest] = text
        for variant_digest, variant_text in new_variants.items():
            self._variants[variant_digest] = (variant_text, digest)
        return digest

    def add_variant(self, text: str, canonical_id: str) -> str:
        """Map the variant ``text`` to the canonical prompt ``canonical_id``; returns the
        variant's digest. A variant already mapped to another canonical prompt, or one that
        is itself a canonical prompt, is a ValueError (the mapping would be ambiguous)."""
        if canonical_id not in self._canonical:
            raise ValueError(f"no canonical prompt {canonical_id!r} is registered")
        digest = prompt_digest(text)
        if digest == canonical_id:
            return digest  # the canonical text is trivially its own variant
        if self._check_variant(text, digest, canonical_id, False):
            if len(self) >= REGISTERED_PROMPTS_MAX:
                raise ValueError(f"the prompt registry is full ({REGISTERED_PROMPTS_MAX} texts)")
            self._variants[digest] = (text, canonical_id)
        return digest

    def _check_variant(self, text: str, digest: str, canonical_id: str, canonical_is_new: bool) -> bool:
        """True when ``text`` is a new variant of ``canonical_id``, False when it is one
        already; a ValueError when it is a canonical prompt or another one's variant."""
        if digest in self._canonical:
            raise ValueError(f"prompt {digest} is a canonical prompt itself; it cannot be a variant of {canonical_id}")
        existing = self._variants.get(digest)
        if existing is None:
            return True
        if existing == (text, canonical_id) and not canonical_is_new:
            return False
        raise ValueError(f"prompt {digest} is already a variant of canonical prompt {existing[1]}")

    def canonical_of(self, text: str) -> tuple[str, str] | None:
        """``(canonical id, canonical text)`` for a registered variant or canonical text,
        else None. The digest finds the entry; the text itself must match too."""
        digest = prompt_digest(text)
        canonical = self._canonical.get(digest)
        if canonical is not None and canonical == text:
            return digest, canonical
        variant = self._variants.get(digest)
        if variant is not None and variant[0] == text:
            return variant[1], self._canonical[variant[1]]
        return None

    def statistics(self) -> RegistryStatistics:
        return RegistryStatistics(canonical_prompts=len(self._canonical), variants=len(self._variants))
