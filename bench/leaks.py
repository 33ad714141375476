"""Leaks planted in traces, and traces with none: what the contribution gate's detectors are
measured on (bench/detectors.py) and tested with (tests/test_detectors.py).

Every kind the reference SDK's `cleanPii` lets through (issue 51's probe): real-looking,
made here from a seeded generator (no real key is written anywhere), each planted in a step's
content, in a step's input (nested: /steps/1/input/headers/Authorization), in a step's
output_summary, in the objective and in the outcome. The clean traces are the reference
fixtures' (tests/fixtures/reference: traces the SDK scored, nothing planted) and the bench's
typical and long corpus: any suspect found in them is a false alarm.
"""

from __future__ import annotations

import copy
import json
import random
import string
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from stdnum import luhn

from bench import corpus
from tests.factories import make_trace, step

REFERENCE = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "reference"


@dataclass(frozen=True, slots=True)
class Leak:
    """`text` holds `secret` (what must not leave), suspected as `type` by `detector`, in a
    trace of privacy level `level`."""

    kind: str
    text: str
    secret: str
    type: str
    detector: str
    level: str = "aggregated"


def _token(rng: random.Random, alphabet: str, n: int) -> str:
    return "".join(rng.choice(alphabet) for _ in range(n))


_ALNUM = string.ascii_letters + string.digits
_LOWER = string.ascii_lowercase + string.digits
_HEX = "0123456789abcdef"
_UPPER = string.ascii_uppercase + string.digits
_B64 = _ALNUM + "+/"


def _card(rng: random.Random, prefix: str, length: int) -> str:
    body = prefix + _token(rng, string.digits, length - len(prefix) - 1)
    return body + luhn.calc_check_digit(body)


def _grouped(number: str, sizes: tuple[int, ...], sep: str) -> str:
    out, at = [], 0
    for size in sizes:
        out.append(number[at : at + size])
        at += size
    return sep.join(out)


def _jwt(rng: random.Random) -> str:
    import base64

    def part(value: dict[str, Any]) -> str:
        raw = json.dumps(value, separators=(",", ":")).encode()
        return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()

    payload = {"sub": str(rng.randrange(10**9)), "name": "Ada Example", "iat": 1718000000}
    signature = _token(rng, _ALNUM + "-_", 43)
    return f"{part({'alg': 'HS256', 'typ': 'JWT'})}.{part(payload)}.{signature}"


def leaks(seed: int = 51) -> list[Leak]:
    """One of each kind, the same for the same seed."""
    rng = random.Random(f"kp-leaks:{seed}")
    jwt = _jwt(rng)
    bearer = _token(rng, _HEX, 40)
    aws_secret = _token(rng, _B64, 40)
    asia = "ASIA" + _token(rng, _UPPER, 16)
    pat = "github_pat_" + _token(rng, _ALNUM, 22) + "_" + _token(rng, _ALNUM, 59)
    ghu = "ghu_" + _token(rng, _ALNUM, 36)
    proj = "sk-proj-" + _token(rng, _ALNUM + "-_", 48)
    ant = "sk-ant-api03-" + _token(rng, _ALNUM + "-_", 93) + "AA"
    live = "sk_live_" + _token(rng, _ALNUM, 24)
    glpat = "glpat-" + _token(rng, _ALNUM + "-_", 20)
    slack_hook = (
        "https://hooks.slack.com/services/T"
        + _token(rng, _UPPER, 8)
        + "/B"
        + _token(rng, _UPPER, 8)
        + "/"
        + _token(rng, _ALNUM, 24)
    )
    sendgrid = "SG." + _token(rng, _ALNUM + "-_", 22) + "." + _token(rng, _ALNUM + "-_", 43)
    body = "\n".join(_token(rng, _B64, 64) for _ in range(6))
    pem = f"-----BEGIN RSA PRIVATE KEY-----\n{body}\n-----END RSA PRIVATE KEY-----"
    openssh = f"-----BEGIN OPENSSH PRIVATE KEY-----\n{body}\n-----END OPENSSH PRIVATE KEY-----"
    visa = _card(rng, "4", 16)
    master = _card(rng, "53", 16)
    amex = _card(rng, "37", 15)
    ssn = f"{rng.randint(100, 665)}-{rng.randint(10, 99)}-{rng.randint(1000, 9999)}"
    openai = "sk-None-" + _token(rng, _ALNUM, 20) + "T3BlbkFJ" + _token(rng, _ALNUM, 20)
    twilio = "AC" + _token(rng, _HEX, 32)
    mailchimp = _token(rng, _LOWER, 32) + "-us14"
    npm = "npm_" + _token(rng, _ALNUM, 36)
    pypi = "pypi-AgEIcHlwaS5vcmc" + _token(rng, _ALNUM + "-_", 80)
    discord = "M" + _token(rng, _ALNUM, 23) + "." + _token(rng, _ALNUM, 6) + "."
    discord += _token(rng, _ALNUM, 27)
    telegram = f"{rng.randint(10**8, 10**9 - 1)}:" + _token(rng, _ALNUM + "-_", 35)
    square = "sq0csp-" + _token(rng, _ALNUM + "-_", 43)
    azure = _token(rng, _B64, 86) + "=="
    artifactory = "AKCp8" + _token(rng, _ALNUM, 68)
    putty = "PuTTY-User-Key-File-2: ssh-rsa"
    password = _token(rng, _ALNUM, 12)
    random_key = _token(rng, _ALNUM, 40)
    hex_key = _token(rng, _HEX, 48)
    return [
        Leak("jwt", f"session {jwt}", jwt, "jwt", "detect-secrets JwtTokenDetector"),
        Leak(
            "bearer, lowercase",
            f"authorization: bearer {bearer}",
            bearer,
            "bearer_token",
            "bearer token, any case",
        ),
        Leak(
            "aws_secret_access_key=",
            f"aws_secret_access_key={aws_secret}",
            aws_secret,
            "api_key",
            "aws_secret_access_key assignment",
        ),
        Leak(
            "ASIA session key", f"key id {asia}", asia, "api_key", "detect-secrets AWSKeyDetector"
        ),
        Leak("github_pat_", f"GH_TOKEN={pat}", pat, "api_key", "key prefix"),
        Leak("ghu_", f"token {ghu} expired", ghu, "api_key", "detect-secrets GitHubTokenDetector"),
        Leak("sk-proj-", f"OPENAI_API_KEY {proj}", proj, "api_key", "key prefix"),
        Leak("sk-ant-", f"x-api-key: {ant}", ant, "api_key", "key prefix"),
        Leak("sk_live_", f"stripe {live}", live, "api_key", "detect-secrets StripeDetector"),
        Leak("glpat-", f"gitlab {glpat}", glpat, "api_key", "detect-secrets GitLabTokenDetector"),
        Leak(
            "Slack webhook",
            f"posted to {slack_hook}",
            slack_hook,
            "api_key",
            "detect-secrets SlackDetector",
        ),
        Leak(
            "SendGrid key",
            f"SENDGRID {sendgrid}",
            sendgrid,
            "api_key",
            "detect-secrets SendGridDetector",
        ),
        Leak("OpenAI key", f"key {openai}", openai, "api_key", "detect-secrets OpenAIDetector"),
        Leak("Twilio SID", f"sid {twilio}", twilio, "api_key", "detect-secrets TwilioKeyDetector"),
        Leak(
            "Mailchimp key",
            f"mailchimp {mailchimp}",
            mailchimp,
            "api_key",
            "detect-secrets MailchimpDetector",
        ),
        Leak(
            "npm token",
            f"//registry.npmjs.org/:_authToken={npm}",
            npm,
            "api_key",
            "detect-secrets NpmDetector",
        ),
        Leak("PyPI token", f"password {pypi}", pypi, "api_key", "detect-secrets PypiTokenDetector"),
        Leak(
            "Discord bot token",
            f"bot {discord}",
            discord,
            "api_key",
            "detect-secrets DiscordBotTokenDetector",
        ),
        Leak(
            "Telegram bot token",
            f"bot {telegram}",
            telegram,
            "api_key",
            "detect-secrets TelegramBotTokenDetector",
        ),
        Leak(
            "Square secret",
            f"square {square}",
            square,
            "api_key",
            "detect-secrets SquareOAuthDetector",
        ),
        Leak(
            "Azure storage key",
            f"DefaultEndpointsProtocol=https;AccountKey={azure}",
            azure,
            "api_key",
            "detect-secrets AzureStorageKeyDetector",
        ),
        Leak(
            "Artifactory token",
            f"X-JFrog-Art-Api: {artifactory} ",
            artifactory,
            "api_key",
            "detect-secrets ArtifactoryDetector",
        ),
        Leak(
            "PuTTY key file",
            f"{putty}\nEncryption: none",
            "PuTTY-User-Key-File-2",
            "private_key",
            "detect-secrets PrivateKeyDetector",
        ),
        Leak("PEM RSA private key", pem, body, "private_key", "PEM private key block"),
        Leak("PEM OpenSSH private key", openssh, body, "private_key", "PEM private key block"),
        Leak(
            "card, Visa, spaced",
            f"card {_grouped(visa, (4, 4, 4, 4), ' ')}",
            _grouped(visa, (4, 4, 4, 4), " "),
            "card_number",
            "stdnum luhn",
        ),
        Leak(
            "card, Mastercard, dashed",
            f"paid with {_grouped(master, (4, 4, 4, 4), '-')}",
            _grouped(master, (4, 4, 4, 4), "-"),
            "card_number",
            "stdnum luhn",
        ),
        Leak("card, Amex, bare", f"amex {amex} exp 09/27", amex, "card_number", "stdnum luhn"),
        Leak("US SSN", f"SSN {ssn}", ssn, "ssn", "stdnum us.ssn"),
        Leak(
            "IPv6",
            "host 2001:db8:85a3::8a2e:370:7334 down",
            "2001:db8:85a3::8a2e:370:7334",
            "ip",
            "ipaddress IPv6",
        ),
        Leak(
            "IPv6, link-local",
            "via fe80::1ff:fe23:4567:890a",
            "fe80::1ff:fe23:4567:890a",
            "ip",
            "ipaddress IPv6",
        ),
        Leak("phone, UK", "call +44 20 7946 0958", "+44 20 7946 0958", "phone", "phonenumbers"),
        Leak(
            "phone, France", "tél. +33 1 42 68 53 00", "+33 1 42 68 53 00", "phone", "phonenumbers"
        ),
        Leak("phone, Germany", "Tel +49 30 901820", "+49 30 901820", "phone", "phonenumbers"),
        Leak("phone, Japan", "電話 +81 3-1234-5678", "+81 3-1234-5678", "phone", "phonenumbers"),
        Leak("phone, India", "ph +91 74104 10123", "+91 74104 10123", "phone", "phonenumbers"),
        Leak(
            "email, fullwidth @",
            "mail ada.lovelace＠example.com",
            "ada.lovelace＠example.com",
            "email",
            "email lookalike",
        ),
        Leak(
            "email, Cyrillic letters",
            "mail ada@ехаmple.com",  # е, х, а: Cyrillic
            "ada@ехаmple.com",
            "email",
            "email lookalike",
        ),
        Leak(
            "email, zero-width space",
            "mail ada.lovelace\u200b@example.com",
            "lovelace\u200b@example.com",
            "email",
            "email lookalike",
        ),
        Leak(
            "email, IDN",
            "mail ada@bücher.example",
            "ada@bücher.example",
            "email",
            "email lookalike",
        ),
        Leak(
            'JSON-style "password": "..."',
            f'config {{"password": "{password}"}}',
            password,
            "password",
            "JSON-style password field",
        ),
        # At "aggregated" the SDK's e-mail pattern takes `password@host`; at "private",
        # where identifiers are kept, the credentials go.
        Leak(
            "URL credentials, private level",
            f"fetch https://deploy:{password}@git.example.com/repo.git",
            password,
            "password",
            "detect-secrets BasicAuthDetector",
            level="private",
        ),
        Leak(
            "random base64 key",
            f"signing key {random_key}",
            random_key,
            "high_entropy_string",
            "detect-secrets Base64HighEntropyString",
        ),
        Leak(
            "random hex key",
            f"hmac {hex_key}",
            hex_key,
            "high_entropy_string",
            "detect-secrets HexHighEntropyString",
        ),
    ]


#: Where a leak is planted: its JSON Pointer in the trace.
PLACES: Final = {
    "content": "/steps/0/content",
    "input": "/steps/1/input/headers/Authorization",
    "output_summary": "/steps/1/output_summary",
    "objective": "/task/objective",
    "outcome": "/outcome/result_summary",
}


def planted(
    text: str, place: str, *, level: str = "aggregated", trace_id: str = "kp:trace:leak-0001"
) -> dict[str, Any]:
    """A clean trace of privacy level `level` with `text` at PLACES[place] (the other fields
    plain)."""
    call = {
        **step(1, "tool_call", "Call the deploy API", tool="http"),
        "input": {"url": "https://api.example.com/deploy", "headers": {"Accept": "*/*"}},
        "output_summary": "202 Accepted",
    }
    trace = make_trace(
        objective="Deploy the service",
        steps=[step(0, "thought", "Plan the deployment"), call],
        trace_id=trace_id,
    )
    trace["outcome"]["result_summary"] = "Deployed"
    trace["metadata"]["privacy_level"] = level
    if place == "content":
        trace["steps"][0]["content"] = f"Plan the deployment: {text}"
    elif place == "input":
        trace["steps"][1]["input"]["headers"]["Authorization"] = text
    elif place == "output_summary":
        trace["steps"][1]["output_summary"] = f"202 Accepted; {text}"
    elif place == "objective":
        trace["task"]["objective"] = f"Deploy the service ({text})"
    elif place == "outcome":
        trace["outcome"]["result_summary"] = f"Deployed; {text}"
    else:
        raise ValueError(f"unknown place {place!r}")
    return trace


def clean_traces(typical: int = 200, long: int = 50, seed: int = 7) -> dict[str, list[Any]]:
    """Traces with nothing planted, by source."""
    no_embedder = json.loads((REFERENCE / "no_embedder.json").read_text(encoding="utf-8"))
    sequence = json.loads((REFERENCE / "embedder_sequence.json").read_text(encoding="utf-8"))
    return {
        "reference fixtures": [
            copy.deepcopy(c["trace"]) for c in no_embedder["cases"] + sequence["cases"]
        ],
        "bench typical": [i.trace for i in corpus.build("typical", typical, seed)],
        "bench long": [i.trace for i in corpus.build("long", long, seed)],
    }
