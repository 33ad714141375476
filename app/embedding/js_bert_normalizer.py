"""BERT text normalisation exactly as transformers.js does it (its `BertNormalizer`) where the
Rust `tokenizers` one differs, and token ids with it (docs/decisions/reference-tokenization.md):
full Unicode lower-casing (a word-final capital sigma becomes "ς"), CJK spacing by UTF-16 code
unit (ideographs past the BMP are not split off), and controls removed by category (Cc, Cf, Co,
Cs; unassigned code points kept). The Rust tokenizer then gets text it must not normalise again.

Speed: the distinct characters of a text are few; each is classified once and only those that
change are replaced (`re` tries a Unicode class's astral ranges one by one for every character
it rejects: 0.2-0.4 us a character).
"""

from __future__ import annotations

import re
import unicodedata
from typing import Final

#: Special tokens are matched in the raw text before normalisation (as added tokens are).
SPECIAL_TOKENS: Final = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
_SPECIAL = re.compile("(" + "|".join(re.escape(t) for t in SPECIAL_TOKENS) + ")")

# JavaScript's \s (ECMA-262 WhiteSpace and LineTerminator).
_JS_WHITESPACE: Final = frozenset(
    "\t\n\v\f\r \u00a0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009\u200a"
    "\u2028\u2029\u202f\u205f\u3000\ufeff"
)
_REMOVED_CATEGORIES: Final = frozenset({"Cc", "Cf", "Co", "Cs"})
_ASCII_CONTROL: Final = re.compile("[\x00-\x1f\x7f]")
_ASCII_CLEAN: Final[dict[int, str | None]] = {
    code: " " if chr(code) in "\t\n\r" else None for code in (*range(0x20), 0x7F)
}


def is_cjk(char: str) -> bool:
    """transformers.js's is_chinese_char, BMP ranges only: its astral ones never match a UTF-16
    code unit."""
    code = ord(char)
    return 0x4E00 <= code <= 0x9FFF or 0x3400 <= code <= 0x4DBF or 0xF900 <= code <= 0xFAFF


def cleaned(char: str) -> str:
    """What clean_text and tokenize_chinese_chars make of one character: "" (removed: controls,
    format characters, private use, surrogates, U+FFFD), " " (whitespace), " c " (CJK), or
    the character itself."""
    if is_cjk(char):  # first: a CJK text has thousands of distinct characters
        return f" {char} "
    if char in "\t\n\r":
        return " "
    if char == "\ufffd" or unicodedata.category(char) in _REMOVED_CATEGORIES:
        return ""
    if char in _JS_WHITESPACE:
        return " "
    return char


def clean(text: str) -> str:
    """clean_text, then tokenize_chinese_chars: the steps before lower-casing."""
    if text.isascii():
        return text.translate(_ASCII_CLEAN) if _ASCII_CONTROL.search(text) else text
    return _clean(text, set(text))


def _clean(text: str, distinct: set[str]) -> str:
    return _replace(text, {c: mapped for c in distinct if (mapped := cleaned(c)) != c})


def _replace(text: str, table: dict[str, str]) -> str:
    """Each character of `table` replaced as it says (no replacement holds another key but
    itself). One `str.replace` a character runs at memory speed; `str.translate` takes about
    50 ns a character, so it is for many keys (a CJK text's ideographs)."""
    if len(table) > 8:
        return text.translate({ord(c): mapped for c, mapped in table.items()})
    for char, mapped in table.items():
        text = text.replace(char, mapped)
    return text


def _normalize_segment(text: str) -> str:
    if text.isascii():
        return clean(text).lower()
    distinct = set(text)
    text = unicodedata.normalize("NFD", _clean(text, distinct).lower())
    # The combining marks the text can hold after NFD: those of its distinct characters'.
    decomposed = unicodedata.normalize("NFD", "".join(distinct).lower())
    marks = {c for c in decomposed if unicodedata.category(c) == "Mn"}
    return _replace(text, dict.fromkeys(marks, "")) if marks else text  # strip_accents


def normalize(text: str) -> str:
    """The text as transformers.js's BertNormalizer leaves it, special tokens kept verbatim."""
    if "[" not in text:
        return _normalize_segment(text)
    return "".join(
        part if i % 2 else _normalize_segment(part) for i, part in enumerate(_SPECIAL.split(text))
    )
