"""The benchmark's fixed corpus: seeded, deterministic traces of known token counts.

Typical traces carry a novelty text of 20 to 120 tokens (special tokens included, as the
service counts them); long traces carry 600 to 1,000, so the 512-token window is full. Every
trace is distinct (its own words and id), so the service's cache grows as it does in real use.

Token counts are exact, not estimated: the words are separated by single spaces, and BERT
pre-tokenisation splits on whitespace and punctuation before WordPiece, so a text's count is
2 ([CLS], [SEP]) plus the sum of its words' counts, each measured once with the tokenizer.

Megabyte traces (issue 15) come close to the request limits (a 1 MiB body, 100,000 characters a
string) with text far past the window, in three kinds: random words in the objective and nine
more steps of them, 1,000 steps of about 900 characters, and 300,000 CJK ideographs without a
space. Their token counts are not measured (tokenizing one takes the better part of a second).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any, Final

import orjson
from tokenizers import Tokenizer

from app.domain.scoring import novelty_text
from app.embedding import model_files
from tests.factories import make_trace, step


def _words(text: str) -> list[str]:
    return text.split()


#: Words of agent traces (code review, data, operations, support, finance, health, legal).
#: scripts/soak.py draws its traces from this list too.
WORDS: Final = _words(
    """
    the a an of to in on for with from by into after before while because when then and or not
    ledger invoice refund latency cache kernel patient dosage contract clause schema index
    query deploy rollback timeout retry vector embedding token policy audit reconcile bank
    statement duplicate posting review security injection handler customer ticket
    function variable parameter request response header payload endpoint service client
    database table column migration transaction lock deadlock replica shard partition
    container image registry cluster node pod namespace secret certificate expiry
    pipeline build artifact dependency version upgrade regression benchmark profile
    error exception stack trace warning failure crash panic overflow underflow leak
    user account permission role session cookie password credential rotation breach
    invoice payment currency exchange rate balance overdraft settlement chargeback
    diagnosis symptom prescription allergy interaction guideline trial cohort
    agreement liability indemnity termination jurisdiction warranty amendment
    found checked verified compared searched opened read wrote updated removed added
    likely unlikely because therefore however instead although unless until
    handler.ts utils.py config.yaml README.md main.go index.js Dockerfile Makefile
    SELECT UPDATE JOIN WHERE NULL HTTP/1.1 TLS DNS UTF-8 JSON CSV OAuth2 gRPC
    v1.2.3 #42 PR-1187 0.35 512 404 503 2025-06-15 10:00Z 3x O(n²)
    unsanitized idempotent non-deterministic back-pressure rate-limited well-formed
    Müller café naïve façade Zürich São Paulo Kraków déjà vu
    """
)

STEP_TYPES: Final = ("thought", "tool_call", "observation")
TOOLS: Final = ("search", "read_file", "run_tests", "http_get", "sql_query", "grep", "edit_file")
DOMAINS: Final = ("default", "finance", "code", "medical", "customer_service", "legal")

TYPICAL_TOKENS: Final = (20, 120)
LONG_TOKENS: Final = (600, 1000)

MEGABYTE_KINDS: Final = ("words", "steps", "cjk")
#: Below the service's limits: KP_MAX_BODY_BYTES (1,048,576) and KP_MAX_STRING_CHARS (100,000).
MEGABYTE_BODY: Final = 1_000_000
STRING_CHARS: Final = 99_000


@dataclass(frozen=True, slots=True)
class Item:
    """One trace and the text the service embeds for it."""

    trace: dict[str, Any]
    text: str
    tokens: int | None  # the whole text's tokens, [CLS] and [SEP] included (None: not counted)


@cache
def _tokenizer() -> Tokenizer:
    tokenizer = Tokenizer.from_file(str(model_files.bundled_tokenizer()))
    tokenizer.no_truncation()
    tokenizer.no_padding()
    return tokenizer


@cache
def word_tokens(word: str) -> int:
    """Tokens of one word, without special tokens."""
    return len(_tokenizer().encode(word, add_special_tokens=False).ids)


def _trace(
    trace_id: str, objective: str, contents: list[str], rng: random.Random
) -> dict[str, Any]:
    steps: list[dict[str, Any]] = []
    for i, content in enumerate(contents):
        kind = "thought" if i == 0 else STEP_TYPES[1 + (i - 1) % 2]
        if kind == "observation" and rng.random() < 0.1:
            kind = "error_recovery"
        tool = rng.choice(TOOLS) if kind == "tool_call" else None
        steps.append(step(i, kind, content, tool=tool))
    return make_trace(
        steps=steps,
        objective=objective,
        domain=rng.choice(DOMAINS),
        success=rng.random() < 0.8,
        confidence=round(rng.uniform(0.3, 1.0), 2),
        trace_id=trace_id,
    )


def _item(trace_id: str, target: int, steps: int, rng: random.Random, seen: set[str]) -> Item:
    """A trace whose novelty text has exactly `target` tokens."""
    while True:
        words: list[str] = []
        count = 2  # [CLS] and [SEP]
        while True:
            word = rng.choice(WORDS)
            n = word_tokens(word)
            if count + n > target:
                continue  # one-token words are common: the loop ends on the target exactly
            words.append(word)
            count += n
            if count == target:
                break
        # The objective takes a few words, the steps share the rest.
        cut = min(len(words) - 1, rng.randint(3, 8))
        objective, rest = " ".join(words[:cut]), words[cut:]
        k = max(1, min(steps, len(rest)))
        bounds = sorted(rng.sample(range(1, len(rest)), k - 1)) if len(rest) > 1 else []
        parts = [rest[a:b] for a, b in zip([0, *bounds], [*bounds, len(rest)], strict=True)]
        contents = [" ".join(p) for p in parts]
        text = novelty_text(objective, contents)
        if text not in seen:
            seen.add(text)
            return Item(_trace(trace_id, objective, contents, rng), text, count)


def build(kind: str, n: int, seed: int) -> list[Item]:
    """`n` distinct items of `kind` ("typical" or "long"), the same for the same seed."""
    rng = random.Random(f"kp-bench:{kind}:{seed}")
    low, high = TYPICAL_TOKENS if kind == "typical" else LONG_TOKENS
    steps = (3, 6) if kind == "typical" else (8, 20)
    seen: set[str] = set()
    return [
        _item(
            f"kp:trace:bench-{kind}-{seed}-{i}",
            rng.randint(low, high),
            rng.randint(*steps),
            rng,
            seen,
        )
        for i in range(n)
    ]


def megabyte(kind: str, n: int, seed: int) -> list[Item]:
    """`n` distinct traces of `kind` (MEGABYTE_KINDS) of about MEGABYTE_BODY bytes of JSON."""
    rng = random.Random(f"kp-bench:megabyte:{kind}:{seed}")
    items = []
    for i in range(n):
        trace_id = f"kp:trace:bench-megabyte-{kind}-{seed}-{i}"
        if kind == "words":  # 12,000+ words to a string, gibberish (several tokens a word)
            strings = [_gibberish(rng, STRING_CHARS) for _ in range(10)]
        elif kind == "steps":  # an agent's 1,000 steps, tool output in each
            strings = [
                "Reconcile the ledgers",
                *(_filled(900, lambda: rng.choice(WORDS)) for _ in range(1000)),
            ]
        elif kind == "cjk":  # 3 bytes of UTF-8 a character: 300,000 in four strings
            strings = [_ideographs(rng, STRING_CHARS) for _ in range(3)] + [
                _ideographs(rng, 30_000)
            ]
        else:
            raise ValueError(f"unknown megabyte kind {kind!r}")
        trace = _trace(trace_id, strings[0], strings[1:], rng)
        size = len(orjson.dumps(trace))
        assert size <= MEGABYTE_BODY, f"{kind}: {size} bytes"
        items.append(Item(trace, novelty_text(strings[0], strings[1:]), None))
    return items


_LETTERS: Final = bytes(ord("a") + byte % 26 for byte in range(256))


def _gibberish(rng: random.Random, chars: int) -> str:
    """Random words of 2 to 9 letters separated by spaces, up to `chars` characters."""
    letters = rng.randbytes(chars).translate(_LETTERS).decode()
    words, at = [], 0
    for length in rng.choices(range(2, 10), k=chars // 2):
        if at + length > chars:
            break
        words.append(letters[at : at + length])
        at += length + 1
    return " ".join(words)


def _ideographs(rng: random.Random, count: int) -> str:
    return "".join(map(chr, rng.choices(range(0x4E00, 0xA000), k=count)))


def _filled(chars: int, word: Callable[[], str]) -> str:
    """Words separated by spaces, up to `chars` characters."""
    words, size = [], -1
    while size + 1 + len(next_word := word()) <= chars:
        words.append(next_word)
        size += 1 + len(next_word)
    return " ".join(words)


def describe_megabyte(items: list[Item]) -> dict[str, float]:
    return {
        "count": len(items),
        "body_bytes_max": max(len(orjson.dumps(i.trace)) for i in items),
        "chars_median": sorted(len(i.text) for i in items)[len(items) // 2],
        "steps": len(items[0].trace["steps"]),
    }


def describe(items: list[Item]) -> dict[str, float]:
    tokens = sorted(i.tokens for i in items if i.tokens is not None)
    return {
        "count": len(items),
        "tokens_min": tokens[0],
        "tokens_median": tokens[len(tokens) // 2],
        "tokens_max": tokens[-1],
    }
