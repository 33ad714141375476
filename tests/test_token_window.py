"""The window of token ids from a prefix of the text equals the whole text's (issue 15).

The oracle is the plain pipeline the service ran before: normalise the whole text, tokenize it
whole with the Rust tokenizer, keep the first ids. Small windows (3 to 40 tokens) put the cuts
everywhere in short texts, so the adversarial places (inside a long word, in a run of
combining marks, at a final sigma, between CJK ideographs, in emoji sequences, around special
tokens) are reached without megabytes of input; the megabyte cases run at the real window.
"""

from __future__ import annotations

import sys
from functools import cache
from typing import Any, cast

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from app.embedding import js_bert_normalizer, model_files, token_window
from app.embedding.onnx_embedder import MAX_TOKENS, load_tokenizer
from app.embedding.token_window import TokenWindow, Window
from tests import regex_normalizer
from tests.conftest import load_fixture

TOKENIZER_CASES = load_fixture("tokenizer_cases.json")["cases"]
SEQUENCE = load_fixture("embedder_sequence.json")["cases"]
UNK = 100


@cache
def tokenizer() -> Tokenizer:
    return load_tokenizer(model_files.bundled_tokenizer())


@cache
def windows() -> list[TokenWindow]:
    """Small windows (first prefix tried, then grown) and the model's own."""
    small = [TokenWindow(tokenizer(), size, first_prefix_chars=f) for size, f in SMALL]
    return [*small, TokenWindow(tokenizer(), MAX_TOKENS)]


SMALL = ((3, 2), (12, 6), (40, 30))


def whole_text_ids(text: str) -> list[int]:
    ids: list[int] = tokenizer().encode(js_bert_normalizer.normalize(text)).ids
    return ids


def assert_windows_equal_whole(text: str) -> None:
    ids = whole_text_ids(text)
    for w in windows():
        assert w.window(text) == Window(ids[: w.size], len(ids) > w.size), (w.size, text[:200])


@pytest.mark.parametrize("case", TOKENIZER_CASES, ids=lambda c: repr(c["text"][:30]))
def test_reference_cases_equal_at_every_window_size(case: dict[str, Any]) -> None:
    """The 1,213 reference tokenizations, and their texts cut small everywhere."""
    model_window = windows()[-1].window(case["text"])
    assert model_window == Window(case["input_ids"], case["token_count"] > MAX_TOKENS)
    assert_windows_equal_whole(case["text"])


def test_reference_sequence_texts_equal_at_every_window_size() -> None:
    for case in SEQUENCE:
        assert_windows_equal_whole(case["text"])


SIGMA_CUTS = [
    # A cut among case-ignorable dots: what follows them decides the sigma's form.
    "ΑΣ" + "." * 40 + "Α tail",  # a cased letter: "σ"
    "ΑΣ" + "." * 40 + "1 tail",  # not cased: "ς"
    "ΑΣ" + "." * 40,  # the text ends: "ς"
    "ΑΣ" + "'" * 30 + "\u200b" * 5 + "’" * 10 + "β" + " x" * 20,  # removed characters skipped
    "ΑΣ" + ".'" * 20 + "[SEP]a",  # a special token ends the lower-cased segment
    "ΑΣ" + "." * 20 + " " + "Α" * 5,  # a space decides
    "ΟΔΟΣ ΟΔΟΣ. ΟΔΟΣ.Α ΣΣΣ.ΣΣ" * 4,
    "Σ" + "." * 30 + "A",  # not preceded by a cased letter: "σ" whatever follows
    "aΣ\u0301\u0301.." * 8 + "b",  # combining marks are case-ignorable too
]

ADVERSARIAL = [
    *SIGMA_CUTS,
    "word " * 10 + "x" * 150 + " word" * 10,  # a word over WordPiece's 100 characters
    ("y" * 99 + " ") * 3 + "y" * 101 + ".z" * 30,  # at and around the limit
    "a" + "\u0301" * 300 + " b" * 20,  # a long run of combining marks
    "e\u0301" * 120 + " " + "\u0345\u0301" * 60,  # marks that NFD reorders
    "中文字" * 60,  # CJK with no spaces: every ideograph is a word
    "\U00020000\U00020001" * 60 + "中",  # astral ideographs are not split (UTF-16 walk)
    "豈更車" * 30,  # compatibility ideographs: NFD maps them, CJK spacing first
    "👨\u200d👩\u200d👧\u200d👦" * 40 + " 🏳️\u200d🌈" * 20,  # ZWJ sequences (ZWJ is removed)
    "👍🏽👍🏿" * 60,
    " \t\n\u00a0\u3000" * 100,  # whitespace only
    "[SEP]" * 40 + "[CLS][UNK]" * 20,  # a cut must not fall inside a special token
    "x]" * 60 + "[CLS" + "]" * 40,
    "." * 200,
    '{"key":"value","n":[1,2,3]},' * 20,  # minified JSON: punctuation, no spaces
    "\x01\x7f\ufffd\U000f0000\u00ad\ufeff" * 40 + " z" * 10,  # removed characters
    "İstanbul ǅemal ΐ ﬁ " * 30,  # lower-casing that changes the length
    "\u037e\u0387\u1fef" * 60,  # punctuation NFD maps to other punctuation
    "한국어 텍스트" * 40,  # Hangul: NFD decomposes to jamo
]


SWEPT = [
    "a b [SEP] c [CLS]d[UNK]][PAD] e" * 2,
    "ΑΣ...Α ΑΣ''1 ΣΣ.. ΑΣ" + "." * 9,
    "x" * 98 + " " + "y" * 103 + ".z",
    "a\u0301\u0301 e\u0345\u0301 中文字豈 👨\u200d👩\u200d👧 ..\u200b.",
]


@pytest.mark.parametrize("text", SWEPT, ids=lambda t: repr(t[:24]))
def test_a_cut_at_every_position_gives_the_whole_texts_window(text: str) -> None:
    """The first prefix tried ends at every position in turn, with windows that its words
    overfill by one or more (so the tokens next to a cut are in the window)."""
    ids = whole_text_ids(text)
    words = len(ids) - 2
    for size in sorted({1, 2, words // 2, words - 2, words - 1}):
        for first in range(1, len(text) + 1):
            window = TokenWindow(tokenizer(), size, first_prefix_chars=first).window(text)
            assert window == Window(ids[:size], True), (size, first)


@pytest.mark.parametrize("text", ADVERSARIAL, ids=lambda t: repr(t[:24]))
def test_adversarial_cuts_equal_the_whole_text(text: str) -> None:
    assert_windows_equal_whole(text)
    assert_windows_equal_whole(text * 6)  # past the model's window too


MEGABYTE = 1_000_000

#: Texts whose window fills early: what comes after costs nothing.
FILLING = {
    "CJK without spaces": "".join(chr(0x4E00 + (i * 7919) % 20000) for i in range(MEGABYTE // 3)),
    "random words": " ".join(f"w{i * 7919 % 100003}" for i in range(MEGABYTE // 7)),
    "a sigma, then dots": "ΑΣ" + "." * MEGABYTE + "Α",
}
#: Texts that never fill it (a few tokens in a megabyte): read whole, once.
NOT_FILLING = {
    "one word": "a" * MEGABYTE,
    "emoji ZWJ sequences": "👨\u200d👩\u200d👧" * (MEGABYTE // 20),
    "combining marks": "e\u0301" * (MEGABYTE // 3),
    "whitespace": " \n" * (MEGABYTE // 2),
}
#: The two that the Rust tokenizer takes longest over in whole are compared at 200 kB.
FULL_SIZE = {"one word", "CJK without spaces", "whitespace", "combining marks"}


@pytest.mark.slow  # megabyte texts tokenized whole: seconds
@pytest.mark.parametrize("name", [*FILLING, *NOT_FILLING])
def test_megabyte_texts_equal_the_whole_text(name: str) -> None:
    text = {**FILLING, **NOT_FILLING}[name]
    text = text if name in FULL_SIZE else text[:200_000]
    ids = whole_text_ids(text)
    assert windows()[-1].window(text) == Window(ids[:MAX_TOKENS], len(ids) > MAX_TOKENS)


@pytest.mark.parametrize("name", [*FILLING, *NOT_FILLING])
def test_a_megabyte_costs_a_window(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """What is normalised stops once the window is full, and the Rust tokenizer never walks a
    long word or a long run of spaces."""
    normalized: list[int] = []
    real = js_bert_normalizer.normalize

    def counting(text: str) -> str:
        normalized.append(len(text))
        return real(text)

    monkeypatch.setattr(js_bert_normalizer, "normalize", counting)
    recording = _Recording(tokenizer())
    TokenWindow(cast(Tokenizer, recording), MAX_TOKENS).window({**FILLING, **NOT_FILLING}[name])
    if name in FILLING:
        assert sum(normalized) < 20_000, normalized
        assert sum(recording.lengths) < 40_000, recording.lengths
    else:
        assert sum(normalized) < 2 * MEGABYTE, normalized
        assert max(recording.lengths) < 1_000, recording.lengths


class _Recording:
    """A tokenizer that records the length of each text it encodes."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self.lengths: list[int] = []
        self.model, self.pre_tokenizer = tokenizer.model, tokenizer.pre_tokenizer
        self.normalizer, self.post_processor = tokenizer.normalizer, tokenizer.post_processor

    def encode(self, text: str) -> Any:
        self.lengths.append(len(text))
        return self._tokenizer.encode(text)


def test_megabyte_of_one_word_is_one_unknown_token() -> None:
    assert windows()[-1].window("ab" * (MEGABYTE // 2)) == Window([101, UNK, 102], False)


# ── properties ───────────────────────────────────────────────────────────────

ATOMS = [
    "word", "Word", "the", "ledger", "Σ", "σ", "ς", "ΑΣ", "ΟΔΟΣ", "ΣΣ", "'", ".", ":", "’",
    "·", "\u05f4", "\uff0e", " ", "  ", "\t", "\n", "\r\n", "\u00a0", "\u3000", "\u2028",
    "\u200b", "\u00ad", "\ufeff", "\u200d", "[CLS]", "[SEP]", "[UNK]", "[PAD]", "[MASK]",
    "[CL", "S]", "]", "[", "中", "文字", "\U00020000", "\uf900", "\u0301", "\u0308", "\u0345",
    "\u0f73", "e\u0301", "é", "İ", "ǅ", "ﬁ", "👨\u200d👩\u200d👧", "👍🏽", "🏳️\u200d🌈", "^", "`",
    "a.b", "A", "1.5", "-", "_", "한국어", "\u037e", "\u1fef", "\u0387", "\x01", "\x7f",
    "\ufffd", "\U000f0000", "\U0001d165\U0001d16d", "ʰ", "Müller", "straße", "\U0001f600",
]  # fmt: skip
RUN_CHARS = ["x", "é", "\u0301", "ʰ", "中", ".", " ", "'", "Σ", "👍", "\u200b", "a\u0301", "]"]

pieces = st.one_of(
    st.sampled_from(ATOMS),
    st.builds(lambda c, n: c * n, st.sampled_from(RUN_CHARS), st.integers(1, 130)),
    st.text(max_size=6),  # any code point, surrogates included
)


@pytest.mark.slow  # 250 texts, each tokenized whole: seconds
@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(pieces, max_size=50).map("".join))
def test_any_text_windows_equal_the_whole_text(text: str) -> None:
    assert_windows_equal_whole(text)


@pytest.mark.slow  # 30 texts past the model's window: the longest test of the file
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(pieces, min_size=400, max_size=900).map("".join))
def test_long_mixed_texts_equal_the_whole_text_at_the_model_window(text: str) -> None:
    ids = whole_text_ids(text)
    assert windows()[-1].window(text) == Window(ids[:MAX_TOKENS], len(ids) > MAX_TOKENS)


@settings(max_examples=400, deadline=None)
@given(st.lists(st.one_of(st.sampled_from(ATOMS), st.text(max_size=8)), max_size=30).map("".join))
def test_normaliser_equals_the_regex_one_it_replaced(text: str) -> None:
    assert js_bert_normalizer.normalize(text) == regex_normalizer.normalize(text)


@pytest.mark.slow  # every code point through both normalisers: seconds
def test_normaliser_equals_the_regex_one_on_every_code_point() -> None:
    text = "".join(map(chr, range(sys.maxunicode + 1))) + "ΑΣ"
    assert js_bert_normalizer.normalize(text) == regex_normalizer.normalize(text)


@pytest.mark.slow  # every code point through the Rust pre-tokenizer: seconds
def test_characters_kept_in_long_words_never_split_a_word() -> None:
    """_shorten_long_words keeps runs of characters _may_split says no to as one word: so
    does the Rust pre-tokenizer, for every code point (its Unicode tables are not Python's)."""
    surrogates = range(0xD800, 0xE000)  # removed by the normaliser: never tokenized
    kept = [
        chr(code)
        for code in range(sys.maxunicode + 1)
        if code not in surrogates and not token_window._may_split(chr(code))
    ]
    pre_tokenizer = tokenizer().pre_tokenizer
    for start in range(0, len(kept), 20_000):
        chunk = "".join(kept[start : start + 20_000])
        assert [w for w, _ in pre_tokenizer.pre_tokenize_str(chunk)] == [chunk]
