"""BERT text normalisation exactly as transformers.js does it (its `BertNormalizer`).

The Rust `tokenizers` normaliser differs from the JavaScript one that the reference runs, and
the differences change token ids (found by tests/test_reference.py on the reference's outputs):

- JavaScript lower-cases with the full Unicode rules, so a word-final capital sigma becomes
  "ς", not "σ" (Python's `str.lower` follows the same rules; Rust's per-character one does not);
- its CJK spacing walks UTF-16 code units, so ideographs outside the Basic Multilingual Plane
  (U+20000 and up) are *not* split into words of their own;
- its control-character test removes Cc, Cf, Co and Cs but keeps unassigned code points.

So the service normalises in Python and hands the Rust tokenizer text it must not normalise
again (`normalizer: null`); pre-tokenisation and WordPiece behave the same in both.
"""

from __future__ import annotations

import json
import re
import sys
import unicodedata
from functools import cache
from pathlib import Path
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


#: The character classes below as code point ranges, computed once for a Unicode version
#: (`python scripts/make_char_classes.py`): building them from `unicodedata` walks all 1.1
#: million code points, about 0.2 s that would otherwise fall on the first request.
CHAR_CLASSES_PATH: Final = Path(__file__).parent / "assets" / "js_bert_char_classes.json"

Ranges = list[tuple[int, int]]


def _ranges(codepoints: list[int]) -> Ranges:
    """Sorted code points as inclusive (first, last) runs."""
    runs: Ranges = []
    for cp in codepoints:
        if runs and runs[-1][1] == cp - 1:
            runs[-1] = (runs[-1][0], cp)
        else:
            runs.append((cp, cp))
    return runs


def compute_char_classes() -> dict[str, Ranges]:
    """What clean_text removes, what it turns into a space, and what strip_accents removes,
    from this Python's Unicode database."""
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
    return {"removed": _ranges(sorted(removed)), "spaces": _ranges(spaces), "marks": _ranges(marks)}


def _stored_char_classes() -> dict[str, Ranges] | None:
    """The shipped classes, if they were computed for this Python's Unicode version."""
    stored = json.loads(CHAR_CLASSES_PATH.read_text(encoding="utf-8"))
    if stored["unicode_version"] != unicodedata.unidata_version:
        return None
    return {name: [(a, b) for a, b in stored[name]] for name in ("removed", "spaces", "marks")}


def _class_of(ranges: Ranges) -> str:
    """A regex character class body."""
    return "".join(
        re.escape(chr(a)) + ("-" + re.escape(chr(b)) if b != a else "") for a, b in ranges
    )


@cache
def _patterns() -> tuple[re.Pattern[str], re.Pattern[str], re.Pattern[str]]:
    classes = _stored_char_classes() or compute_char_classes()
    return (
        re.compile(f"[{_class_of(classes['removed'])}]+"),
        re.compile(f"[{_class_of(classes['spaces'])}]"),
        re.compile(f"[{_class_of(classes['marks'])}]+"),
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


def warm_up() -> None:
    """Build the character classes now rather than on the first request."""
    _patterns()
