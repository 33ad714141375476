"""One model run as the workers call it: tokenize, group texts of similar token length, run
each group (padding does not change a vector: the attention mask hides it and the pooling
ignores it, so grouping only saves the work of padded tokens)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Final

import numpy as np
import numpy.typing as npt

from app.embedding.onnx_embedder import OnnxEmbedder, TokenizedText
from app.embedding.types import Embedding

#: Texts in one run may be this much longer than its shortest (padding it does for nothing).
MAX_PADDING: Final = 0.25
#: ... plus this many tokens, so that short texts (where 25% is a token or two) share a run.
PADDING_SLACK_TOKENS: Final = 4


def length_groups(
    tokenized: Sequence[TokenizedText], max_size: int, max_padding: float = MAX_PADDING
) -> list[list[int]]:
    """Indices grouped into model runs of similar length (padding at most `max_padding`)."""
    order = sorted(range(len(tokenized)), key=lambda i: len(tokenized[i].ids))
    groups: list[list[int]] = []
    for i in order:
        length = len(tokenized[i].ids)
        if groups:
            group = groups[-1]
            shortest = len(tokenized[group[0]].ids)
            if (
                len(group) < max_size
                and length <= shortest * (1 + max_padding) + PADDING_SLACK_TOKENS
            ):
                group.append(i)
                continue
        groups.append([i])
    return groups


class ModelBackend:
    """Runs the embedder the lifecycle loaded (`embedder` returns it; None before a load)."""

    def __init__(self, embedder: Callable[[], OnnxEmbedder | None], batch_size: int) -> None:
        self._embedder = embedder
        self.batch_size = batch_size

    def __call__(self, texts: list[str], one_core: bool = False) -> list[Embedding]:
        embedder = self._embedder()
        if embedder is None:
            raise RuntimeError("the model is not loaded")
        tokenized = embedder.tokenize(texts)
        vectors: list[npt.NDArray[np.float32] | None] = [None] * len(texts)
        for group in length_groups(tokenized, self.batch_size):
            rows = embedder.embed_tokenized([tokenized[i] for i in group], one_core=one_core)
            for i, row in zip(group, rows, strict=True):
                vectors[i] = row
        return [
            Embedding(vector, t.token_count, t.truncated)
            for vector, t in zip(vectors, tokenized, strict=True)
            if vector is not None
        ]
