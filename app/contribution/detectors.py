"""Suspected leaks that the reference SDK's `cleanPii` patterns leave in a text: secrets and
identifiers found by maintained detectors, where one exists, and by a few small checks of ours
for what they miss (docs/contribution.md lists each with an example; the choice and its figures:
docs/decisions/leak-detectors.md).

- Yelp's detect-secrets: its plugins for provider keys and tokens, JWTs, private keys, and
  high-entropy strings, through their public plugin API
  (`analyze_string`; for the high-entropy ones their `charset`, `calculate_shannon_entropy` and
  `entropy_limit`, read over every run of their characters as its ad hoc scan reads a text).
  Never their `verify` (it calls the providers' servers) nor the global settings. Its
  KeywordDetector is not used: a microsecond a character (a second a megabyte).
- Google's phonenumbers: numbers of every region written in international form (`+44 ...`).
- python-stdnum: card numbers (the Luhn check) and US social security numbers (their rules).
- The standard library's ipaddress: IPv6 addresses.
- Ours, each a documented pattern: PEM private key blocks, token prefixes detect-secrets 1.5
  does not know (`github_pat_`, `sk-ant-`, `sk-proj-`), bearer tokens in any case,
  `aws_secret_access_key=` unquoted, JSON-style `"password": "..."` fields, and e-mail
  addresses the SDK's ASCII pattern misses once the text is read as a person reads it
  (NFKC: a fullwidth `@`; format characters such as zero-width spaces dropped; letters of any
  script: Cyrillic look-alikes, IDNs).

A suspect is a span of the text with its type (the SDK's names where one fits: api_key,
bearer_token, password, email, phone, ip; else private_key, jwt, card_number, ssn,
high_entropy_string) and the detector that found it; never its text. Identifiers (email,
phone, ip, ssn) are not looked for at privacy_level "private", where the SDK keeps them.

Pure, and linear in the text: every pattern here is a scan without nested repetition. Each
detector has a screen, a pattern that every one of its matches holds and that the engine
scans for fast (a literal first): run once over the trace's texts joined, then over a text, so
that a detector reads a text only when it may hold something for it.
"""

from __future__ import annotations

import bisect
import ipaddress
import itertools
import re
import string
import unicodedata
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Final, Literal

import phonenumbers
from detect_secrets.plugins.artifactory import ArtifactoryDetector
from detect_secrets.plugins.aws import AWSKeyDetector
from detect_secrets.plugins.azure_storage_key import AzureStorageKeyDetector
from detect_secrets.plugins.base import BasePlugin
from detect_secrets.plugins.basic_auth import BasicAuthDetector
from detect_secrets.plugins.discord import DiscordBotTokenDetector
from detect_secrets.plugins.github_token import GitHubTokenDetector
from detect_secrets.plugins.gitlab_token import GitLabTokenDetector
from detect_secrets.plugins.high_entropy_strings import (
    Base64HighEntropyString,
    HexHighEntropyString,
    HighEntropyStringsPlugin,
)
from detect_secrets.plugins.jwt import JwtTokenDetector
from detect_secrets.plugins.mailchimp import MailchimpDetector
from detect_secrets.plugins.npm import NpmDetector
from detect_secrets.plugins.openai import OpenAIDetector
from detect_secrets.plugins.private_key import PrivateKeyDetector
from detect_secrets.plugins.pypi_token import PypiTokenDetector
from detect_secrets.plugins.sendgrid import SendGridDetector
from detect_secrets.plugins.slack import SlackDetector
from detect_secrets.plugins.square_oauth import SquareOAuthDetector
from detect_secrets.plugins.stripe import StripeDetector
from detect_secrets.plugins.telegram_token import TelegramBotTokenDetector
from detect_secrets.plugins.twilio import TwilioKeyDetector
from stdnum import luhn
from stdnum.us import ssn

Category = Literal["secret", "identifier"]
Span = tuple[int, int]


@dataclass(frozen=True, slots=True)
class Suspect:
    """`text[start:end]` is suspected to be a `type` (found by `detector`)."""

    type: str
    detector: str
    start: int
    end: int


class Screen:
    """Which of a trace's texts may hold a detector's match (a superset), cheaply."""

    def holders(self, texts: Sequence[str], joined: str, starts: Sequence[int]) -> Iterator[int]:
        raise NotImplementedError


class _Needs(Screen):
    """Texts holding a match of `pattern`, something every match of the detector holds, that
    the engine scans for fast (a literal or a small character class first): one scan of the
    texts joined, each match naming the text it starts in."""

    def __init__(self, pattern: str) -> None:
        self.pattern = re.compile(pattern)

    def holders(self, texts: Sequence[str], joined: str, starts: Sequence[int]) -> Iterator[int]:
        at = 0
        while (match := self.pattern.search(joined, at)) is not None:
            i = bisect.bisect_right(starts, match.start()) - 1
            yield i
            if i + 1 >= len(starts):
                return
            at = starts[i + 1]


class _Run(Screen):
    """Texts holding a run of `length` or more of `charset` (ASCII), found in their UTF-8 with
    each byte mapped to a mark (one pass in C, then a substring search): a character class
    repeated is slow for the engine, every position starting a run."""

    def __init__(self, charset: str, length: int) -> None:
        self.table = bytes(ord("a") if chr(b) in charset else ord(" ") for b in range(256))
        self.run = b"a" * length

    def holders(self, texts: Sequence[str], joined: str, starts: Sequence[int]) -> Iterator[int]:
        if self.run not in joined.encode("utf-8", "surrogatepass").translate(self.table):
            return  # most traces: no text to read one by one
        for i, text in enumerate(texts):
            if self.run in text.encode("utf-8", "surrogatepass").translate(self.table):
                yield i


class _Digits(Screen):
    """Texts whose digits, spaced or dashed, take a shape (`pattern`, over 0 for a digit, s for
    a space or dash, x for anything else): found in their UTF-8 mapped byte by byte (one pass
    in C), the pattern's literal first digit then found fast."""

    _TABLE = bytes(
        ord("0") if chr(b).isdigit() and b < 128 else ord("s") if chr(b) in " -" else ord("x")
        for b in range(256)
    )

    def __init__(self, pattern: bytes) -> None:
        self.pattern = re.compile(pattern)

    def holders(self, texts: Sequence[str], joined: str, starts: Sequence[int]) -> Iterator[int]:
        whole = joined.encode("utf-8", "surrogatepass").translate(self._TABLE)
        if self.pattern.search(whole) is None:
            return  # most traces: no text to read one by one
        for i, text in enumerate(texts):
            shape = text.encode("utf-8", "surrogatepass").translate(self._TABLE)
            if self.pattern.search(shape) is not None:
                yield i


class Detector:
    """One detector: `name` (as the answer names it), the `type` it finds, its category,
    `spans(text)`, and its `screen`."""

    name: str
    type: str
    category: Category
    screen: Screen

    def spans(self, text: str) -> Iterable[Span]:
        raise NotImplementedError


# -- detect-secrets ----------------------------------------------------------------------------

#: What a token found by a plugin runs on to (a JWT's signature past its lazy match, the tail of
#: a key longer than the plugin's pattern): redacted whole.
_TOKEN_TAIL = re.compile(r"[A-Za-z0-9_\-]*")
_QUOTES = "'\"`"


class _Plugin(Detector):
    """A detect-secrets plugin: the values its `analyze_string` yields, found in the text."""

    def __init__(
        self, plugin: BasePlugin, type_: str, screen: Screen, *, token: bool = True
    ) -> None:
        self.plugin = plugin
        self.name = f"detect-secrets {type(plugin).__name__}"
        self.type = type_
        self.category = "secret"
        self.screen = screen
        #: The value is a token: its whole run of token characters is the secret.
        self.token = token

    def spans(self, text: str) -> Iterator[Span]:
        values = {value for value in self.plugin.analyze_string(text) if value}
        for value in values:
            yield from self._places(text, value, 0)

    def _places(self, text: str, value: str, start: int) -> Iterator[Span]:
        at = text.find(value, start)
        while at != -1:
            end = at + len(value)
            if self.token:
                tail = _TOKEN_TAIL.match(text, end)
                end = tail.end() if tail else end
            yield at, end
            at = text.find(value, end)


class _Entropy(Detector):
    """A detect-secrets high-entropy plugin, read as its ad hoc string scan reads (every run of
    its characters, quoted or not), keeping the runs past its entropy limit. A run too short
    to pass the limit (n characters have at most log2(n) bits) is not measured."""

    def __init__(self, plugin: HighEntropyStringsPlugin) -> None:
        self.plugin = plugin
        self.name = f"detect-secrets {type(plugin).__name__}"
        self.type = "high_entropy_string"
        self.category = "secret"
        shortest = int(2**plugin.entropy_limit) + 1
        self.screen = _Run(plugin.charset, shortest)
        self.runs = re.compile(f"[{re.escape(plugin.charset)}]{{{shortest},}}")

    def spans(self, text: str) -> Iterator[Span]:
        limit = self.plugin.entropy_limit
        for run in self.runs.finditer(text):
            if self.plugin.calculate_shannon_entropy(run.group()) > limit:
                yield run.span()


# -- the libraries' checks over our candidates ------------------------------------------------


class _Candidates(Detector):
    """Candidates found by a pattern, kept when `accept` (a library's check) takes them."""

    def __init__(
        self,
        name: str,
        type_: str,
        category: Category,
        pattern: str,
        accept: Callable[[str], bool],
        screen: Screen,
    ) -> None:
        self.name = name
        self.type = type_
        self.category = category
        self.pattern = re.compile(pattern)
        self.accept = accept
        self.screen = screen

    def spans(self, text: str) -> Iterator[Span]:
        for match in self.pattern.finditer(text):
            value = match.group("value") if "value" in self.pattern.groupindex else match.group()
            if self.accept(value):
                yield match.span("value") if "value" in self.pattern.groupindex else match.span()


_DIGITS = re.compile(r"[0-9]")


def _card(candidate: str) -> bool:
    digits = "".join(_DIGITS.findall(candidate))
    return 13 <= len(digits) <= 19 and luhn.is_valid(digits)


def _ssn(candidate: str) -> bool:
    return bool(ssn.is_valid(candidate.replace(" ", "-")))


def _ipv6(candidate: str) -> bool:
    try:
        address = ipaddress.IPv6Address(candidate)
    except ValueError:
        return False
    groups = sum(1 for group in candidate.split(":") if group)
    return groups >= 3 and not (address.is_unspecified or address.is_loopback)


class _Phones(Detector):
    """phonenumbers' matcher with no default region: numbers written with their country code
    (`+44 20 7946 0958`), valid for their region's plan."""

    name = "phonenumbers"
    type = "phone"
    category: Category = "identifier"
    screen = _Needs(r"[+\uff0b][\s(]*\d")  # any script's digits, as phonenumbers reads them

    def spans(self, text: str) -> Iterator[Span]:
        for match in phonenumbers.PhoneNumberMatcher(text, None):
            yield match.start, match.end


# -- ours ---------------------------------------------------------------------------------------


class _Pattern(Detector):
    """One of our patterns: the span of its `value` group (else the whole match)."""

    def __init__(self, name: str, type_: str, pattern: str, needs: str, flags: int = 0) -> None:
        self.name = name
        self.type = type_
        self.category = "secret"
        self.pattern = re.compile(pattern, flags)
        self.screen = _Needs(needs)

    def spans(self, text: str) -> Iterator[Span]:
        group = "value" if "value" in self.pattern.groupindex else 0
        for match in self.pattern.finditer(text):
            yield match.span(group)


#: A PEM private key block: its header to its footer (or to where its base64 body ends).
_PEM = (
    r"-----BEGIN (?:[A-Z0-9]+ )*PRIVATE KEY(?: BLOCK)?-----"
    r"(?:[A-Za-z0-9+/=:,\-\s]*?-----END (?:[A-Z0-9]+ )*PRIVATE KEY(?: BLOCK)?-----"
    r"|[A-Za-z0-9+/=:,\-\s]*)"
)
#: Key prefixes detect-secrets 1.5 does not know: GitHub's fine-grained tokens, Anthropic's and
#: OpenAI's project, service-account and admin keys (the SDK's `sk-[A-Za-z0-9]{20,}` stops at
#: their second dash).
_PREFIXED = (
    r"(?<![A-Za-z0-9_])(?:github_pat_|sk-ant-|sk-(?:proj|svcacct|admin)-)[A-Za-z0-9_\-]{20,}"
)
#: A bearer token in any case (the SDK's pattern: `Bearer` capitalised, 20 characters or more).
_BEARER = r"\b[Bb][Ee][Aa][Rr][Ee][Rr][ \t]+(?P<value>[A-Za-z0-9_\-.~+/]{16,}=*)"
#: A secret in a JSON-style field: its name quoted, then a colon (the SDK's password pattern
#: wants the separator right after the name, so `"password": "..."` escapes it).
_JSON_PASSWORD = (
    r"[\"'][\w.\-]*?(?:password|passwd|pwd|secret|token|api_?key|private_?key)[\"'][ \t]*:[ \t]*"
    r"[\"'](?P<value>[^\"'\n]+)[\"']"
)
#: AWS's secret key assigned without quotes (detect-secrets' pattern wants them).
_AWS_SECRET = (
    r"aws_?secret_?(?:access_?)?key[\"']?[ \t]*[=:][ \t]*[\"']?"
    r"(?P<value>[A-Za-z0-9/+=]{40})(?![A-Za-z0-9/+=])"
)


class _Emails(Detector):
    """Addresses the SDK's ASCII pattern cannot see: found in the text as NFKC reads it (a
    fullwidth or small `@` is `@`), format characters (zero-width spaces, joiners, soft
    hyphens) dropped, with letters and digits of any script. Only around an at sign, each
    window read character by character so that a span maps back to the text."""

    name = "email lookalike"
    type = "email"
    category: Category = "identifier"
    _AT = re.compile("[@\uff20\ufe6b]")
    screen = _Needs(_AT.pattern)
    _ADDRESS = re.compile(r"[\w.%+\-]+@(?:[\w\-]+\.)+[^\W\d_]{2,}")
    #: An address is at most 64 + 1 + 255 characters: how far from its at sign to read.
    _REACH = 320

    def spans(self, text: str) -> Iterator[Span]:
        upto = 0
        for at in self._AT.finditer(text):
            if at.start() < upto:
                continue
            low, high = max(upto, at.start() - self._REACH), at.end() + self._REACH
            normal, where = _normalised(text, low, min(high, len(text)))
            for match in self._ADDRESS.finditer(normal):
                start, end = where[match.start()], where[match.end() - 1] + 1
                yield start, end
                upto = max(upto, end)


def _normalised(text: str, low: int, high: int) -> tuple[str, list[int]]:
    """`text[low:high]` as NFKC reads it, format characters dropped, and for each of its
    characters the index in `text` it came from."""
    out: list[str] = []
    where: list[int] = []
    for i in range(low, high):
        char = text[i]
        if char.isascii():
            out.append(char)
            where.append(i)
            continue
        if unicodedata.category(char) == "Cf":
            continue
        for piece in unicodedata.normalize("NFKC", char):
            out.append(piece)
            where.append(i)
    return "".join(out), where


# -- the detectors, in order: an earlier one's span wins an overlap ---------------------------

#: What a token of the plugins below holds, each of its matches: a run of 20 or more of these
#: characters (checked against their patterns: tests/test_detectors.py).
_TOKEN_RUN = _Run(string.ascii_letters + string.digits + "_-+/=.", 20)

DETECTORS: Final[tuple[Detector, ...]] = (
    _Pattern("PEM private key block", "private_key", _PEM, r"-----BEGIN "),
    _Plugin(PrivateKeyDetector(), "private_key", _Needs(r"PRIVATE KEY|PuTTY"), token=False),
    _Plugin(JwtTokenDetector(), "jwt", _Needs(r"eyJ")),
    _Pattern("key prefix", "api_key", _PREFIXED, r"github_pat_|sk-(?:ant|proj|svcacct|admin)-"),
    _Plugin(AWSKeyDetector(), "api_key", _TOKEN_RUN),
    _Pattern(
        "aws_secret_access_key assignment",
        "api_key",
        _AWS_SECRET,
        r"[Aa][Ww][Ss]_?[Ss][Ee][Cc][Rr][Ee][Tt]",
    ),
    _Plugin(GitHubTokenDetector(), "api_key", _Needs(r"gh[pousr]_")),
    _Plugin(GitLabTokenDetector(), "api_key", _Needs(r"gl[a-z]+-|GR1348941")),
    _Plugin(OpenAIDetector(), "api_key", _Needs(r"T3BlbkFJ")),
    _Plugin(StripeDetector(), "api_key", _Needs(r"k_live_")),
    _Plugin(SlackDetector(), "api_key", _Needs(r"[Xx][Oo][Xx][AaBbPpOoSsRr]-|hooks\.slack\.com")),
    _Plugin(TwilioKeyDetector(), "api_key", _Needs(r"[AS][CK][a-z0-9]{32}")),
    _Plugin(SendGridDetector(), "api_key", _Needs(r"SG\.")),
    _Plugin(MailchimpDetector(), "api_key", _Needs(r"-us[0-9]")),
    _Plugin(NpmDetector(), "api_key", _Needs(r"_authToken")),
    _Plugin(PypiTokenDetector(), "api_key", _Needs(r"pypi-")),
    _Plugin(DiscordBotTokenDetector(), "api_key", _TOKEN_RUN),
    _Plugin(TelegramBotTokenDetector(), "api_key", _Needs(r"[0-9]:[0-9A-Za-z_\-]{35}")),
    _Plugin(SquareOAuthDetector(), "api_key", _Needs(r"sq0csp-")),
    _Plugin(AzureStorageKeyDetector(), "api_key", _Needs(r"AccountKey=")),
    _Plugin(ArtifactoryDetector(), "api_key", _Needs(r"AKC|AP[0-9A-F]")),
    _Pattern("bearer token, any case", "bearer_token", _BEARER, r"[Bb][Ee][Aa][Rr][Ee][Rr]"),
    _Plugin(BasicAuthDetector(), "password", _Needs(r"://"), token=False),
    _Pattern(
        "JSON-style password field", "password", _JSON_PASSWORD, r"[\"'][ \t]*:", re.IGNORECASE
    ),
    _Candidates(
        "stdnum luhn",
        "card_number",
        "secret",
        r"(?<![0-9])[2-6](?:[ \-]?[0-9]){12,18}(?![0-9])",
        _card,
        _Digits(rb"0000s?0000s?0000"),
    ),
    _Candidates(
        "stdnum us.ssn",
        "ssn",
        "identifier",
        r"(?<![0-9\-])[0-9]{3}([ \-])[0-9]{2}\1[0-9]{4}(?![0-9\-])",
        _ssn,
        _Digits(rb"000s00s0000"),
    ),
    _Candidates(
        "ipaddress IPv6",
        "ip",
        "identifier",
        r"(?<![0-9A-Za-z:.])(?:[0-9A-Fa-f]{0,4}:){2,7}[0-9A-Fa-f]{0,4}(?![0-9A-Za-z:])",
        _ipv6,
        _Needs(r":[0-9A-Fa-f]{0,4}:"),
    ),
    _Phones(),
    _Emails(),
    _Entropy(Base64HighEntropyString()),
    _Entropy(HexHighEntropyString()),
)


def detect(texts: Sequence[str], *, identifiers: bool = True) -> list[list[Suspect]]:
    """The suspects in each of `texts` (the strings of one trace), each text's in order of
    place, none overlapping; `identifiers`: look for identifiers too (not at "private")."""
    found: list[_Taken] = [_Taken() for _ in texts]
    if not texts:
        return []
    joined = "\n".join(texts)
    starts = list(itertools.accumulate((len(t) + 1 for t in texts[:-1]), initial=0))
    for detector in DETECTORS:
        if not identifiers and detector.category == "identifier":
            continue
        for i in detector.screen.holders(texts, joined, starts):
            taken = found[i]
            for start, end in detector.spans(texts[i]):
                taken.add(Suspect(detector.type, detector.name, start, end))
    return [taken.suspects for taken in found]


class _Taken:
    """A text's suspects so far, in order of place, none overlapping: a suspect overlapping
    one taken is left out (the earlier detector's span wins)."""

    __slots__ = ("starts", "suspects")

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.suspects: list[Suspect] = []

    def add(self, suspect: Suspect) -> None:
        if suspect.end <= suspect.start:
            return
        i = bisect.bisect_left(self.starts, suspect.end)
        # Taken spans do not overlap, so those starting before this one's end end in order:
        # only the last of them can reach past its start.
        if i and self.suspects[i - 1].end > suspect.start:
            return
        self.starts.insert(i, suspect.start)
        self.suspects.insert(i, suspect)


def redact(text: str, suspects: Sequence[Suspect]) -> str:
    """`text` with each suspect (in order of place, none overlapping) as `[REDACTED:<type>]`,
    the SDK's placeholder."""
    if not suspects:
        return text
    pieces: list[str] = []
    last = 0
    for s in suspects:
        pieces += (text[last : s.start], f"[REDACTED:{s.type}]")
        last = s.end
    pieces.append(text[last:])
    return "".join(pieces)


__all__ = ["DETECTORS", "Detector", "Suspect", "detect", "redact"]
