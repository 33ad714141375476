"""The model's window of a text's token ids, from as little of the text as it takes to fill it
(docs/decisions/token-window.md): a prefix is normalised and tokenized, cut where the whole
text's normalisation and pre-tokenisation split too, and grown until the words before the cut
fill the window; the ids are then exactly the whole text's first ones.

A cut before the character at index k is clean when:

- that character's normalisation starts with a space (whitespace, CJK ideographs) or with
  punctuation the pre-tokenizer isolates, of canonical combining class 0 (NFD reorders marks
  only between two such starters, so nothing crosses k; every other step of the normaliser
  maps one character without looking at its neighbours);
- no special token of the raw text spans k (they are matched before normalisation);
- a capital sigma whose form ("ς" at the end of a word) is decided past k (case-ignorable
  characters, such as "." and "'", are skipped over) gets the whole text's form in the prefix.

Then the normalised prefix starts the normalised text and ends at a word boundary, and
WordPiece, a word at a time, gives its words the whole text's ids.
"""

from __future__ import annotations

import itertools
import re
import string
import unicodedata
from dataclasses import dataclass
from functools import cache
from typing import Final

from tokenizers import Tokenizer
from tokenizers.models import WordPiece
from tokenizers.pre_tokenizers import BertPreTokenizer

from app.embedding import js_bert_normalizer as normalizer

_CAPITAL_SIGMA: Final = "\u03a3"
_SMALL_SIGMA: Final = "\u03c3"
#: Characters the pre-tokenizer might split a word at, besides those of Unicode's P* categories:
#: ASCII punctuation and whitespace, and two that the Rust tokenizer's older Unicode tables still
#: call punctuation (tests/test_token_window.py checks every code point).
_OTHER_SPLITS: Final = frozenset(string.punctuation + string.whitespace + "\u166d\U000111c9")
#: The pre-tokenizer drops whitespace: a run of spaces splits words as one space does, and
#: squeezing them first spares the Rust tokenizer a slow pass over a long run.
_SPACES: Final = re.compile("  +")


@dataclass(frozen=True, slots=True)
class Window:
    ids: list[int]  # the first `size` ids of the whole text's, special tokens included
    truncated: bool  # the whole text has more


class TokenWindow:
    """Token windows of texts for a `tokenizer` whose normaliser is js_bert_normalizer: from
    prefixes with a BERT pre-tokenizer and a WordPiece model (the proofs above are about them),
    else from the whole text."""

    def __init__(self, tokenizer: Tokenizer, size: int, *, first_prefix_chars: int = 0) -> None:
        self._tokenizer = tokenizer
        self.size = size
        #: The first prefix tried: a CJK text fills the window with it (one token a character).
        self._first_prefix_chars = first_prefix_chars or size + size // 4
        model, pre_tokenizer = tokenizer.model, tokenizer.pre_tokenizer
        bert = isinstance(model, WordPiece) and isinstance(pre_tokenizer, BertPreTokenizer)
        self._bert = bert and tokenizer.normalizer is None
        self._long_word = model.max_input_chars_per_word if self._bert else 0
        processor = tokenizer.post_processor
        self._special_tokens = processor.num_special_tokens_to_add(False) if processor else 0

    def prepare(self) -> None:
        """Builds the cut characters now (about 0.1 s) rather than on the first text longer
        than the first prefix; a typical text never needs them."""
        if self._bert:
            _cut_characters()

    def window(self, text: str) -> Window:
        limit = self._first_prefix_chars
        while self._bert and len(text) > limit:
            cut = self._cut(text, limit)
            if cut is None:
                break
            ids = self.encode(_prefix(text, cut))
            words = len(ids) - self._special_tokens  # tokens of the words before the cut
            if words > self.size:
                return Window(ids[: self.size], truncated=True)
            # Aim at the window from the tokens per character so far; at least double.
            wanted = cut * (self.size + self.size // 4) // max(words, 1)
            limit = min(8 * cut, max(2 * cut, wanted))
        ids = self.encode(text)
        return Window(ids[: self.size], truncated=len(ids) > self.size)

    def encode(self, text: str) -> list[int]:
        """All ids of `text` (special tokens included), as its whole tokenization gives them."""
        normalized = normalizer.normalize(text)
        if self._long_word:
            normalized = _shorten_long_words(_SPACES.sub(" ", normalized), self._long_word)
        ids: list[int] = self._tokenizer.encode(normalized).ids
        return ids

    def _cut(self, text: str, start: int) -> int | None:
        """The first clean cut at or after `start`, if any."""
        cut_chars = _cut_characters()
        while (found := cut_chars.search(text, start)) is not None:
            cut = found.start()
            if not _inside_special_token(text, cut):
                return cut
            start = cut + 1
        return None


@cache
def _cut_characters() -> re.Pattern[str]:
    """The cut characters of the Basic Multilingual Plane (a character class with astral
    members is slow to search; the few astral punctuation marks are simply not cuts)."""
    pre_tokenizer = BertPreTokenizer()
    codes = []
    for code in range(0x10000):
        char = chr(code)
        if not (
            normalizer.is_cjk(char) or unicodedata.category(char)[0] in "PSZ" or char in "\t\n\r"
        ):
            continue  # a letter, a digit, a mark or a removed character
        first = normalizer.normalize(char)[:1]  # a CJK ideograph's is a space
        if first == " " or (
            first
            and unicodedata.combining(first) == 0
            and [w for w, _ in pre_tokenizer.pre_tokenize_str(f"a{first}a")] == ["a", first, "a"]
        ):
            codes.append(code)
    # Runs of consecutive code points written as ranges: 28,000 single characters would take
    # `re` 0.08 s more to compile.
    runs = [list(run) for _, run in itertools.groupby(enumerate(codes), lambda p: p[1] - p[0])]
    ranges = (f"{re.escape(chr(run[0][1]))}-{re.escape(chr(run[-1][1]))}" for run in runs)
    return re.compile(f"[{''.join(ranges)}]")


def _inside_special_token(text: str, cut: int) -> bool:
    """Whether a special token of the raw text starts before `cut` and ends after it."""
    return any(
        text.find(token, max(0, cut - len(token) + 1), cut + len(token) - 1) != -1
        for token in normalizer.SPECIAL_TOKENS
    )


def _prefix(text: str, cut: int) -> str:
    """text[:cut], its last capital sigma lower-cased as in the whole text when what decides
    it lies past the cut."""
    prefix = text[:cut]
    at = prefix.rfind(_CAPITAL_SIGMA)
    if at < 0 or _sigma_form(prefix[at:]) is not None:
        return prefix  # no sigma, or decided within the prefix
    end, form = cut, None
    while form is None and end < len(text):
        end = min(len(text), end + max(end - at, 64))
        form = _sigma_form(text[at:end])
    if form != _SMALL_SIGMA:
        return prefix  # word-final (or undecided to the end) in both
    return prefix[:at] + _SMALL_SIGMA + prefix[at + 1 :]


def _sigma_form(span: str) -> str | None:
    """What lower-casing makes of the capital sigma that starts `span`, after a cased letter:
    "σ" if the next character that is not case-ignorable is cased, "ς" if it is not; None if
    `span` ends before such a character (then what follows the span decides)."""
    cleaned = normalizer.clean("A" + span)  # lower-casing sees the cleaned text
    at_end = cleaned.lower()[1]
    return at_end if (cleaned + "A").lower()[1] == at_end else None


def _shorten_long_words(text: str, longest: int) -> str:
    """`text` (normalised) with each run of more than `longest` characters the pre-tokenizer
    cannot split replaced by `longest` + 1 "x"s: the word holding it is one [UNK] either way,
    and the Rust tokenizer spends about 0.5 us a character on a single long word."""
    if re.search(f"[^ ]{{{longest + 1}}}", text) is None:
        return text  # after normalisation every whitespace character is a space
    pieces = text.split(" ")
    placeholder = "x" * (longest + 1)
    for i, piece in enumerate(pieces):
        if len(piece) <= longest:
            continue
        splits = sorted(c for c in set(piece) if _may_split(c))
        unsplit = f"[^{''.join(map(re.escape, splits))}]" if splits else "(?s:.)"
        pieces[i] = re.sub(f"{unsplit}{{{longest + 1},}}", placeholder, piece)
    return " ".join(pieces)


def _may_split(char: str) -> bool:
    """Whether BertPreTokenizer might split at `char` (whitespace, ASCII or Unicode punctuation)."""
    return char in _OTHER_SPLITS or char.isspace() or unicodedata.category(char)[0] == "P"
