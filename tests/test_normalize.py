"""Prompt normalization (perf/prompt_normalize.py, used by the CDN replay): each rule, idempotence, the property
that prompts with different content never merge, and that layout-only variants of a
system prompt get the same block keys."""
from __future__ import annotations

import random
import sys
import threading
import unicodedata
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "perf"))

from kvtier.common.keys import KVLayout, Namespace, chain_keys  # noqa: E402
from prompt_normalize import (COMMON_MARKER_PATTERNS, LINE_WHITESPACE, MARKER_PATTERNS_MAX,  # noqa: E402
                              TEXT_CHARS_MAX, UNICODE_SPACE_SEPARATORS, NormalizeConfig, Normalizer)
from prompt_registry import REGISTERED_PROMPTS_MAX, CanonicalPromptRegistry, prompt_digest  # noqa: E402

MARKERS = NormalizeConfig(marker_patterns=COMMON_MARKER_PATTERNS)


def system(text: str, config: NormalizeConfig = MARKERS) -> str:
    return Normalizer(config).normalize_system(text)


# -- each rule -------------------------------------------------------------------------
def test_space_separators_are_exactly_unicode_category_zs():
    zs = "".join(chr(c) for c in range(sys.maxunicode + 1) if unicodedata.category(chr(c)) == "Zs")
    assert UNICODE_SPACE_SEPARATORS == zs
    assert LINE_WHITESPACE == "\t\v\f" + zs


def test_leading_bom_is_removed_and_an_inner_one_is_content():
    n = Normalizer()
    assert n.normalize_text("\ufeffhello") == "hello"
    assert n.normalize_text("hel\ufefflo") == "hel\ufefflo"
    assert Normalizer(NormalizeConfig(remove_leading_bom=False)).normalize_text("\ufeffhi") == "\ufeffhi"


def test_crlf_and_lone_cr_become_lf_and_unicode_separators_stay():
    n = Normalizer()
    assert n.normalize_text("a\r\nb\rc\nd") == "a\nb\nc\nd"
    assert n.normalize_text("a\r\r\nb") == "a\n\nb"  # CR then CRLF: two line endings
    assert n.normalize_text("a\u2028b\x85c") == "a\u2028b\x85c"
    assert Normalizer(NormalizeConfig(unify_line_endings=False)).normalize_text("a\r\nb") == "a\r\nb"


def test_nfc_composes_canonical_equivalents_but_does_not_fold_compatibility_forms():
    n = Normalizer()
    assert n.normalize_text("Cafe\u0301") == "Caf\u00e9"
    assert n.normalize_text("\u212b") == "\u00c5"  # ANGSTROM SIGN is canonically A with ring
    assert n.normalize_text("\ufb01 x\u00b2") == "\ufb01 x\u00b2"  # the fi ligature and superscript two stay
    assert Normalizer(NormalizeConfig(unicode_nfc=False)).normalize_text("e\u0301") == "e\u0301"


def test_trailing_whitespace_goes_and_indentation_and_inner_spaces_stay():
    n = Normalizer()
    text = "def f():  \t\n    return  1\u00a0\u3000\n\tx \f"
    assert n.normalize_text(text) == "def f():\n    return  1\n\tx"
    assert Normalizer(NormalizeConfig(strip_trailing_whitespace=False)).normalize_text("a  \nb") == "a  \nb"


def test_runs_of_blank_lines_are_shortened_to_the_limit():
    n = Normalizer()
    assert n.normalize_text("a\n\n\n\nb\n\nc\nd") == "a\n\nb\n\nc\nd"
    assert n.normalize_text("a\n \t\n\u3000\nb") == "a\n\nb"  # whitespace-only lines are blank
    assert Normalizer(NormalizeConfig(blank_lines_max=0)).normalize_text("a\n\n\nb") == "a\nb"
    assert Normalizer(NormalizeConfig(blank_lines_max=2)).normalize_text("a\n\n\n\n\nb") == "a\n\n\nb"
    assert Normalizer(NormalizeConfig(blank_lines_max=None)).normalize_text("a\n\n\n\nb") == "a\n\n\n\nb"


def test_system_prompt_edges_are_stripped_and_other_messages_keep_theirs_by_default():
    assert system("\n\n  You are kind.  \n\n") == "You are kind."
    assert Normalizer().normalize_text("\n  hi\n") == "\n  hi\n"
    assert Normalizer(NormalizeConfig(strip_message_edges=True)).normalize_text("\n  hi\n") == "hi"
    assert Normalizer(NormalizeConfig(strip_system_edges=False)).normalize_system("  hi ") == "  hi"


def test_marker_patterns_remove_version_comment_and_date_stamps():
    assert system("You are kind.\nVersion: 2.3\nBe brief.") == "You are kind.\nBe brief."
    assert system("You are kind.\nversion v12.0.1\nBe brief.") == "You are kind.\nBe brief."
    assert system("<!-- v12 -->You are kind. <!-- version 3.1 -->") == "You are kind."
    assert system("Last updated: 2026-11-30\nYou are kind.") == "You are kind."
    assert system("You are kind.\nLAST UPDATED: 2026-11-30 08:15") == "You are kind."
    # a marker inside a sentence is content unless a pattern says otherwise
    assert system("Use API version 2.3 only.") == "Use API version 2.3 only."
    assert system("Updated on 2026-11-30, you are kind.") == "Updated on 2026-11-30, you are kind."


def test_markers_apply_to_system_prompts_only():
    n = Normalizer(MARKERS)
    assert n.normalize_text("Version: 2.3\nhello") == "Version: 2.3\nhello"
    out = n.normalize_messages([{"role": "system", "content": "Version: 2.3\nhi"},
                                {"role": "user", "content": "Version: 2.3\nhi"}])
    assert [m["content"] for m in out] == ["hi", "Version: 2.3\nhi"]


def test_custom_markers_and_roles():
    cfg = NormalizeConfig(marker_patterns=(r"\[build [0-9a-f]{7}\]",), system_roles=("system", "developer"))
    n = Normalizer(cfg)
    out = n.normalize_messages([{"role": "developer", "content": "Rules [build 1a2b3c4]\r\n"},
                                {"role": "assistant", "content": "ok [build 1a2b3c4]"}])
    assert [m["content"] for m in out] == ["Rules", "ok [build 1a2b3c4]"]


def test_removing_a_marker_that_uncovers_another_reaches_a_fixed_point():
    n = Normalizer(NormalizeConfig(marker_patterns=(r"<!-- v\d+ -->",)))
    assert n.normalize_system("a <!-- v<!-- v1 -->2 --> b") == "a  b"
    # a marker between a letter and a combining mark: the pair composes once it is gone
    assert n.normalize_system("Cafe<!-- v3 -->\u0301") == "Caf\u00e9"


def test_bad_config_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="not a valid regular expression"):
        NormalizeConfig(marker_patterns=("(unclosed",))
    with pytest.raises(ValueError, match="matches the empty string"):
        NormalizeConfig(marker_patterns=(r"x*",))
    with pytest.raises(ValueError, match="over the limit"):
        NormalizeConfig(marker_patterns=tuple(f"m{i}" for i in range(MARKER_PATTERNS_MAX + 1)))
    with pytest.raises(ValueError, match="blank_lines_max"):
        NormalizeConfig(blank_lines_max=-1)
    with pytest.raises(ValueError, match="must be a bool"):
        NormalizeConfig(unicode_nfc="yes")
    with pytest.raises(ValueError, match="system_roles"):
        NormalizeConfig(system_roles=("",))


def test_bad_input_is_refused_with_the_reason():
    n = Normalizer()
    with pytest.raises(ValueError, match="must be a str"):
        n.normalize_system(b"bytes")
    with pytest.raises(ValueError, match="over the limit"):
        n.normalize_text("x" * (TEXT_CHARS_MAX + 1))
    with pytest.raises(ValueError, match="list of dicts"):
        n.normalize_messages("hello")
    with pytest.raises(ValueError, match="message 1 must be a dict"):
        n.normalize_messages([{"role": "user", "content": "a"}, "b"])
    with pytest.raises(ValueError, match="message 0 has no string 'role'"):
        n.normalize_messages([{"content": "a"}])
    with pytest.raises(ValueError, match="message 0 content"):
        n.normalize_messages([{"role": "user", "content": 3}])
    with pytest.raises(ValueError, match="over the limit"):
        n.normalize_messages([{"role": "user", "content": "a"},
                              {"role": "user", "content": [{"type": "text", "text": "x" * (TEXT_CHARS_MAX + 1)}]}])
    assert n.statistics().texts == 0  # a call that raised changed nothing, not even the counts


def test_messages_keep_other_keys_and_parts_and_the_input_is_untouched():
    n = Normalizer(MARKERS)
    messages = [
        {"role": "system", "content": "Version: 1\r\nBe kind.  ", "name": "ops"},
        {"role": "user", "content": [{"type": "text", "text": "hi  \r\n"}, {"type": "image_url", "image_url": "u  "}]},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "t1"}]},
    ]
    snapshot = repr(messages)
    out = n.normalize_messages(messages)
    assert repr(messages) == snapshot
    assert out == [
        {"role": "system", "content": "Be kind.", "name": "ops"},
        {"role": "user", "content": [{"type": "text", "text": "hi\n"}, {"type": "image_url", "image_url": "u  "}]},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "t1"}]},
    ]


def test_statistics_count_what_happened():
    n = Normalizer(MARKERS)
    canonical_id = n.register_canonical("Be kind.", variants=["Be kind!"])
    n.normalize_system("Be kind.")  # unchanged, already canonical
    n.normalize_system("Version: 2\nBe kind!\r\n")  # a marker, a line ending, then the canonical text
    n.normalize_messages([{"role": "user", "content": "x  "}, {"role": "user", "content": "y"}])
    s = n.statistics()
    assert (s.system_prompts, s.texts, s.texts_changed, s.markers_removed, s.canonical_mapped) == (2, 4, 2, 1, 1)
    assert (s.canonical_prompts, s.variants) == (1, 1)
    assert n.system_prompt_id("Be kind!") == canonical_id == prompt_digest("Be kind.")


# -- the registry ----------------------------------------------------------------------
def test_registered_variants_map_to_the_canonical_text_and_nothing_else_does():
    n = Normalizer(MARKERS)
    canonical_id = n.register_canonical("You are a support agent for ACME.\n\nBe brief.")
    n.register_variant("You are a support agent for ACME Corp.\nBe brief.", canonical_id)
    assert n.normalize_system("  You are a support agent for ACME Corp.\r\nBe brief.\n") == (
        "You are a support agent for ACME.\n\nBe brief.")
    assert n.normalize_system("Version: 3\nYou are a support agent for ACME.\n\n\nBe brief.") == (
        "You are a support agent for ACME.\n\nBe brief.")
    # a near miss of a registered variant is not mapped
    assert n.normalize_system("You are a support agent for ACME Corp!\nBe brief.") == (
        "You are a support agent for ACME Corp!\nBe brief.")
    # the mapping applies to system prompts only
    assert n.normalize_text("You are a support agent for ACME Corp.\nBe brief.") == (
        "You are a support agent for ACME Corp.\nBe brief.")


def test_registry_refuses_ambiguous_mappings():
    n = Normalizer()
    a = n.register_canonical("prompt A")
    b = n.register_canonical("prompt B")
    assert n.register_canonical("prompt A  ") == a  # the same text after normalization
    n.register_variant("prompt A'", a)
    assert n.register_variant("prompt A'\r\n", a) == prompt_digest("prompt A'")  # again: no change
    with pytest.raises(ValueError, match="already a variant of canonical prompt " + a):
        n.register_variant("prompt A'", b)
    with pytest.raises(ValueError, match="is a canonical prompt itself"):
        n.register_variant("prompt B", a)
    with pytest.raises(ValueError, match="already registered as a variant"):
        n.register_canonical("prompt A'")
    with pytest.raises(ValueError, match="no canonical prompt"):
        n.register_variant("prompt C", "00" * 16)
    # all or nothing: the conflict in the second variant registers neither the canonical text nor the first variant
    with pytest.raises(ValueError, match="already a variant of canonical prompt " + a):
        n.register_canonical("prompt D", variants=["prompt D'", "prompt A'"])
    assert n.normalize_system("prompt D'") == "prompt D'"
    assert (n.statistics().canonical_prompts, n.statistics().variants) == (2, 1)
    assert n.register_canonical("prompt A", variants=["prompt A'", "prompt A"]) == a  # again: no change


def test_registry_confirms_the_text_behind_a_digest_and_has_a_size_limit(monkeypatch):
    registry = CanonicalPromptRegistry()
    cid = registry.add_canonical("canonical")
    registry.add_variant("variant", cid)
    # plant an entry under the digest of another text: lookup must compare texts, not trust the digest
    registry._variants[prompt_digest("impostor")] = ("variant", cid)
    assert registry.canonical_of("impostor") is None
    assert registry.canonical_of("variant") == (cid, "canonical")
    monkeypatch.setattr("prompt_registry.REGISTERED_PROMPTS_MAX", len(registry))
    with pytest.raises(ValueError, match="registry is full"):
        registry.add_canonical("one more")
    assert REGISTERED_PROMPTS_MAX > 1000


# -- properties ------------------------------------------------------------------------
# Content characters: no whitespace, no line endings, nothing that can spell a marker
# (no ':', '<', '!', '-'), none that composes under NFC with a neighbour.
CONTENT = ("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,;?()'\"/#*_"
           "\u00e9\u00fc\u00df\u00c5\u4f60\u597d\u4e16\u754c\u03b1\u03b2\U0001f642")
LAYOUT = [" ", "  ", "\t", "\n", "\n\n", "\n\n\n", "\r\n", "\r", " \r\n", "\u00a0\n", "\u3000"]
MARKER_LINES = ["Version: 2.3\n", "version v7\n", "Last updated: 2026-11-30\n", "<!-- v12 -->"]


def random_prompt(rng: random.Random) -> str:
    parts = [rng.choice(["", " ", "\n", "\ufeff", "\r\n  "])]
    for _ in range(rng.randint(1, 40)):
        roll = rng.random()
        if roll < 0.6:
            parts.append("".join(rng.choice(CONTENT) for _ in range(rng.randint(1, 8))))
        elif roll < 0.9:
            parts.append(rng.choice(LAYOUT))
        else:
            parts.append("\n" + rng.choice(MARKER_LINES))
    return "".join(parts)


def content_positions(text: str) -> list[int]:
    """Indices of content characters outside any marker."""
    spans = [range(m.start(), m.end()) for p in MARKERS.compiled_markers() for m in p.finditer(text)]
    return [i for i, ch in enumerate(text) if ch in CONTENT and not any(i in s for s in spans)]


def mutate_content(rng: random.Random, text: str) -> str | None:
    """``text`` with one content character substituted, inserted or deleted."""
    positions = content_positions(text)
    kind = rng.choice(["substitute", "insert", "delete"])
    if kind == "insert":
        i = rng.randint(0, len(text))
        return text[:i] + rng.choice(CONTENT) + text[i:]
    if not positions:
        return None
    i = rng.choice(positions)
    if kind == "delete":
        return text[:i] + text[i + 1:]
    return text[:i] + rng.choice([c for c in CONTENT if c != text[i]]) + text[i + 1:]


def test_normalization_is_idempotent():
    rng = random.Random(20261201)
    n = Normalizer(MARKERS)
    for _ in range(2000):
        text = random_prompt(rng)
        once = n.normalize_system(text)
        assert n.normalize_system(once) == once, repr(text)
        plain = n.normalize_text(text)
        assert n.normalize_text(plain) == plain, repr(text)


def test_prompts_whose_content_differs_never_merge():
    rng = random.Random(7)
    n = Normalizer(MARKERS)
    checked = 0
    while checked < 3000:
        a = random_prompt(rng)
        b = mutate_content(rng, a)
        if b is None or b == a:
            continue
        for marker in MARKERS.compiled_markers():  # the mutation must not have made or broken a marker
            if marker.findall(a) != marker.findall(b):
                break
        else:
            assert n.normalize_system(a) != n.normalize_system(b), (a, b)
            assert n.normalize_text(a) != n.normalize_text(b), (a, b)
            checked += 1


def layout_variant(rng: random.Random, text: str) -> str:
    """The same prompt with only layout changed: line endings, trailing whitespace, longer
    blank-line runs, edges, decomposed letters, other marker versions."""
    lines = text.split("\n")
    out = []
    for line in lines:
        if rng.random() < 0.3:
            out.append("Version: %d.%d" % (rng.randint(0, 9), rng.randint(0, 99)))  # a line of its own
        if rng.random() < 0.3:
            line += rng.choice([" ", "\t", "  \u00a0", "\u3000"])
        line = line.replace("\u00e9", "e\u0301") if rng.random() < 0.5 else line
        out.append(line)
        if not line.strip() and rng.random() < 0.5:
            out.append("")  # a blank line made a longer run of blank lines
    ending = rng.choice(["\n", "\r\n"])
    return rng.choice(["", "\n\n", "  ", "\ufeff"]) + ending.join(out) + rng.choice(["", "\n", " \r\n\r\n"])


def tokenize(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def test_layout_variants_share_the_text_and_the_block_keys():
    rng = random.Random(11)
    ns = Namespace("normalize-test", KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, block_tokens=4))
    n = Normalizer(MARKERS)
    base = ("You are the ACME support agent.\n\nAnswer in \u00e9l\u00e9gant French.\n"
            "Version: 2.3\n\n\n- be brief\n- be kind\n\nLast updated: 2026-11-30")
    expected = n.normalize_system(base)
    assert "Version" not in expected and "\r" not in expected
    expected_keys = chain_keys(ns.id, tokenize(expected), 4)
    assert len(expected_keys) >= 15
    for _ in range(500):
        variant = layout_variant(rng, base)
        normalized = n.normalize_system(variant)
        assert normalized == expected, repr(variant)
        assert ns.keys(tokenize(normalized)) == expected_keys
    raw = "You are the ACME support agent.\r\n\r\n"
    assert chain_keys(ns.id, tokenize(raw), 4) != chain_keys(ns.id, tokenize(n.normalize_system(raw)), 4)


def test_one_normalizer_shared_by_threads_counts_every_call():
    n = Normalizer(MARKERS)
    n.register_canonical("shared prompt")

    def work():
        for i in range(200):
            n.normalize_system(f"Version: {i}\nshared prompt ")

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    s = n.statistics()
    assert (s.system_prompts, s.markers_removed, s.texts_changed) == (800, 800, 800)
