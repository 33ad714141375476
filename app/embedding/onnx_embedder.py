"""all-MiniLM-L6-v2 sentence embeddings with onnxruntime and the `tokenizers` library, equal to
those of the reference SDK's transformers.js `feature-extraction` pipeline (mean pooling,
normalised; docs/decisions/reference-tokenization.md): the model reads a text's first 512 ids as
they are (token_window.py: a long text's window ends with its 512th token, not [SEP]), and
pooling sums in float64 and rounds to float32 where transformers.js does.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable, Sequence
from operator import attrgetter
from pathlib import Path
from typing import Final, cast

import numpy as np
import numpy.typing as npt
import onnxruntime as ort
from tokenizers import Tokenizer

from app.core.errors import PartError
from app.core.states import Precision
from app.embedding.int8_support import Int8Weights, int8_support
from app.embedding.session_cache import LEVEL, PROVIDERS, Outcome, SessionCache
from app.embedding.token_window import TokenWindow, Window
from app.embedding.types import Embedding

#: The model's window (`model_max_length` in tokenizer_config.json).
MAX_TOKENS: Final = 512
_INPUTS: Final = ("input_ids", "attention_mask", "token_type_ids")
#: 122 tokens: the long end of a typical trace's text.
WARM_UP_TEXT: Final = " ".join(["warm up"] * 60)
_OUTPUT: Final = "last_hidden_state"


class ModelError(PartError):
    """The model or tokenizer file cannot be used."""


class OnnxEmbedder:
    """The tokenizer and the onnxruntime session(s), created once and reused."""

    dimensions: Final = 384

    def __init__(
        self,
        model_path: Path,
        tokenizer_path: Path,
        *,
        intra_op_threads: int = 0,
        concurrent_runs: int = 1,
        precision: Precision = "float32",
        defer: bool = False,
        int8_weights: Int8Weights | None = None,
        spinning: bool = True,
        session_cache: SessionCache | None = None,
        model_sha256: Callable[[], str] | None = None,
    ) -> None:
        """`defer`: open only what a first answer needs (the main session, not yet run);
        `finish_loading` does the rest. `int8_weights`: in int8 mode, the weights' type
        int8_support() chose (None: ask it now). `spinning`: whether the main session's idle
        threads spin (onnxruntime's default) or sleep. `session_cache`: where the optimised
        graph is kept between starts. `model_sha256`: the model file's, when the caller checks
        it (else the bytes are hashed), called after the tokenizer's load to run beside it."""
        self._window = TokenWindow(load_tokenizer(tokenizer_path), MAX_TOKENS)
        # The PyPI wheel ships with telemetry on; a scoring service does not phone home.
        ort.disable_telemetry_events()
        self.precision: Final = precision
        self._model_path = model_path
        # Read at the first need and kept: a session loaded from the session cache needs none
        # (23 MB less to read on the way to a first answer).
        model = functools.cache(functools.partial(_read_model, model_path, precision, int8_weights))
        sha256 = None if model_sha256 is None else model_sha256()  # a failed check raises
        self._cache: tuple[SessionCache, str] | None = None
        if session_cache is None:
            model()  # a bad file or int8 mode declined: said now, as ever
        else:
            # int8 mode rewrites the file's graph: the bytes loaded are then not the file's.
            if sha256 is None or precision != "float32":
                sha256 = hashlib.sha256(model()).hexdigest()
            self._cache = (session_cache, sha256)
        #: How the main session came to be, when there is a session cache.
        self.cache_outcome: Outcome | None = None
        self._session = self._open(model, intra_op_threads, spinning)
        # Until the one-core session is open, runs side by side share the main one.
        self._one_core_session = self._session
        #: Kept until the one-core session is opened from it.
        self._model: Callable[[], bytes] | None = model if concurrent_runs > 1 else None
        if not defer:
            self.finish_loading()

    def finish_loading(self) -> None:
        """Opens the one-core session that serves every run side by side (concurrent run() calls
        are safe), then runs each session once: a first run sets up its buffers."""
        if self._model is not None:
            self._one_core_session = self._open(self._model, 1, True, main=False)
            self._model = None
        self._window.prepare()
        (text,) = self.tokenize([WARM_UP_TEXT])
        self.embed_tokenized([text])
        if self._one_core_session is not self._session:
            self.embed_tokenized([text], one_core=True)

    def _open(
        self, model: Callable[[], bytes], threads: int, spinning: bool, *, main: bool = True
    ) -> ort.InferenceSession:
        options = functools.partial(_session_options, threads, spinning)
        try:
            if self._cache is None:
                session = ort.InferenceSession(model(), options(), providers=PROVIDERS)
            else:
                cache, digest = self._cache
                session, outcome = cache.session(model, digest, options)
                if main:
                    self.cache_outcome = outcome
        except ModelError:
            raise
        except Exception as exc:
            raise ModelError(f"model {self._model_path} cannot be loaded: {exc}") from exc
        _check_signature(session, self._model_path)
        return session

    def tokenize(self, texts: Sequence[str]) -> list[Window]:
        return list(map(self._window.window, texts))

    def embed_tokenized(
        self, batch: Sequence[Window], *, one_core: bool = False
    ) -> npt.NDArray[np.float32]:
        """Unit vectors, one row per text, from one model run over the padded batch (`one_core`:
        on the single-threaded session, with the same vectors). In int8 mode each text has a run
        of its own: the activations' scale covers the whole run, so texts sharing one would move
        each other's vectors."""
        if self.precision == "int8" and len(batch) > 1:
            return np.concatenate([self.embed_tokenized([t], one_core=one_core) for t in batch])
        length = 0
        for tokens in batch:
            length = max(length, len(tokens.ids))
        input_ids = np.zeros((len(batch), length), dtype=np.int64)
        attention_mask = np.zeros((len(batch), length), dtype=np.int64)
        for row, tokens in enumerate(batch):
            input_ids[row, : len(tokens.ids)] = tokens.ids
            attention_mask[row, : len(tokens.ids)] = 1
        hidden: npt.NDArray[np.float32]
        session = self._one_core_session if one_core else self._session
        feed = {"input_ids": input_ids, "attention_mask": attention_mask}
        (hidden,) = session.run([_OUTPUT], feed | {"token_type_ids": np.zeros_like(input_ids)})
        # Mean over the unmasked tokens, then L2 normalisation, rounded as transformers.js rounds.
        mask = attention_mask.astype(np.float64)[:, :, None]
        summed = (hidden.astype(np.float64) * mask).sum(axis=1)
        wide = (summed / mask.sum(axis=1)).astype(np.float32).astype(np.float64)
        norms = np.sqrt((wide * wide).sum(axis=1, keepdims=True)).astype(np.float32)
        unit: npt.NDArray[np.float32] = (wide / norms.astype(np.float64)).astype(np.float32)
        return unit

    def embed(self, texts: Sequence[str]) -> npt.NDArray[np.float32]:
        return self.embed_tokenized(self.tokenize(texts))

    def embed_grouped(
        self, texts: Sequence[str], *, one_core: bool = False, max_group: int = 32
    ) -> list[Embedding]:
        """The texts' embeddings in their order, from runs over texts of similar token length
        (docs/decisions/scheduler-length-groups.md): padding costs work, not accuracy."""
        tokenized = self.tokenize(texts)
        found: list[Embedding | None] = [None] * len(texts)
        for group in length_groups(tokenized, max_group):
            batch = list(map(tokenized.__getitem__, group))
            rows = self.embed_tokenized(batch, one_core=one_core)
            for i, tokens, row in zip(group, batch, rows, strict=True):
                found[i] = Embedding(row, len(tokens.ids), tokens.truncated)
        return cast(list[Embedding], found)


#: Texts in one run may be this much longer than its shortest (padding it does for nothing).
MAX_PADDING: Final = 0.25
#: ... plus this many tokens, so that short texts (where 25% is a token or two) share a run.
PADDING_SLACK_TOKENS: Final = 4


def length_groups(tokenized: Sequence[Window], max_size: int) -> list[list[int]]:
    """Indices grouped into model runs of similar length (padding at most MAX_PADDING)."""
    lengths = list(map(len, map(attrgetter("ids"), tokenized)))
    groups: list[list[int]] = []
    longest = 0.0  # the current group's limit
    for i in sorted(range(len(lengths)), key=lengths.__getitem__):
        length = lengths[i]
        if groups and len(groups[-1]) < max_size and length <= longest:
            groups[-1].append(i)
        else:
            groups.append([i])
            longest = length * (1 + MAX_PADDING) + PADDING_SLACK_TOKENS
    return groups


def _read_model(model_path: Path, precision: Precision, int8_weights: Int8Weights | None) -> bytes:
    """The model's bytes, rewritten for int8 activations in int8 mode."""
    try:
        model = model_path.read_bytes()
    except OSError as exc:
        raise ModelError(f"cannot read {model_path}: {exc.strerror or exc}") from exc
    if precision == "float32":
        return model
    if int8_weights is None:
        support = int8_support()
        if support.weights is None:
            raise ModelError(support.reason)
        int8_weights = support.weights
    from app.embedding.int8_activations import int8_activation_model

    try:
        return int8_activation_model(model, int8_weights)
    except Exception as exc:  # a ValueError naming the setting, or a graph onnx cannot parse
        raise ModelError(f"model {model_path}: int8 mode unavailable: {exc}") from exc


def _session_options(intra_op_threads: int, spinning: bool) -> ort.SessionOptions:
    # BASIC, not ALL (the reference's), and spinning as onnxruntime ships it unless turned off:
    # docs/decisions/onnxruntime-session-options.md.
    options = ort.SessionOptions()
    options.graph_optimization_level = LEVEL
    options.intra_op_num_threads = intra_op_threads
    options.log_severity_level = 3
    if not spinning:
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    # No `session.x64quantprecision` for int8 mode: int8_support.py says why.
    return options


def _check_signature(session: ort.InferenceSession, model_path: Path) -> None:
    inputs = {i.name for i in session.get_inputs()}
    outputs = [o.name for o in session.get_outputs()]
    if not set(_INPUTS) <= inputs or _OUTPUT not in outputs:
        raise ModelError(
            f"model {model_path} is not a MiniLM export: inputs {sorted(inputs)}, "
            f"outputs {outputs}; expected inputs {list(_INPUTS)} and output {_OUTPUT}"
        )


def load_tokenizer(path: Path) -> Tokenizer:
    """The WordPiece tokenizer of tokenizer.json, set up to match transformers.js."""
    try:
        tokenizer = Tokenizer.from_file(str(path))
        # Normalisation is done the JavaScript way in js_bert_normalizer, before this tokenizer.
        tokenizer.normalizer = None
    except Exception as exc:
        raise ModelError(f"tokenizer {path} cannot be loaded: {exc}") from exc
    # tokenizer.json carries sentence-transformers' 128-token settings; transformers.js ignores
    # them (it cuts at model_max_length, 512, after the fact), so this does too.
    tokenizer.no_truncation()
    tokenizer.no_padding()
    return tokenizer
