"""The first js_bert_normalizer, kept as an oracle for the faster one that replaced it.

It matched character classes of the Unicode database with regular expressions over the whole
text; tests/test_reference.py proved it on the reference's 1,213 tokenizer cases. The service's
normaliser must give the same text for every input (tests/test_token_window.py).
"""

from __future__ import annotations

import re
import sys
import unicodedata
from functools import cache
from typing import Final

#: Special tokens are matched in the raw text before normalisation (as added tokens are).
SPECIAL_TOKENS: Final = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
_SPECIAL = re.compile("(" + "|".join(re.escape(t) for t in SPECIAL_TOKENS) + ")")

# JavaScript's \s (ECMA-262 WhiteSpace and LineTerminator).
_JS_WHITESPACE: Final = (
    "\t\n\v\f\r \u00a0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009\u200a"
    "\u2028\u2029\u202f\u205f\u3000\ufeff"
)
# BMP ranges of transformers.js's is_chinese_char; its astral ranges can never match a code unit.
_CJK = re.compile("([\u4e00-\u9fff\u3400-\u4dbf\uf900-\ufaff])")


def _class_of(codepoints: list[int]) -> str:
    """A regex character class body, with runs of code points written as ranges."""
    parts, start = [], None
    for i, cp in enumerate(codepoints):
        if start is None:
            start = cp
        if i + 1 == len(codepoints) or codepoints[i + 1] != cp + 1:
            parts.append(re.escape(chr(start)) + ("-" + re.escape(chr(cp)) if cp != start else ""))
            start = None
    return "".join(parts)


@cache
def _patterns() -> tuple[re.Pattern[str], re.Pattern[str], re.Pattern[str]]:
    """Character classes built once from the Unicode database."""
    removed, spaces, marks = [0, 0xFFFD], [], []
    for cp in range(sys.maxunicode + 1):
        ch = chr(cp)
        category = unicodedata.category(ch)
        if ch in "\t\n\r":
            spaces.append(cp)
        elif category in ("Cc", "Cf", "Co", "Cs"):
            removed.append(cp)
        elif ch in _JS_WHITESPACE:
            spaces.append(cp)
        if category == "Mn":
            marks.append(cp)
    return (
        re.compile(f"[{_class_of(removed)}]+"),
        re.compile(f"[{_class_of(spaces)}]"),
        re.compile(f"[{_class_of(marks)}]+"),
    )


def _normalize_segment(text: str) -> str:
    removed, spaces, marks = _patterns()
    text = spaces.sub(" ", removed.sub("", text))  # clean_text
    text = _CJK.sub(r" \1 ", text)  # tokenize_chinese_chars
    text = text.lower()
    if text.isascii():
        return text
    return marks.sub("", unicodedata.normalize("NFD", text))  # strip_accents


def normalize(text: str) -> str:
    """The text as transformers.js's BertNormalizer leaves it, special tokens kept verbatim."""
    if text.isascii() and "[" not in text:
        return _normalize_segment(text)
    return "".join(
        part if i % 2 else _normalize_segment(part) for i, part in enumerate(_SPECIAL.split(text))
    )
