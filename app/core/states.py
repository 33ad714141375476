"""Names of states and reasons shared by every layer, from the model to the API's answers.

A leaf: it imports nothing from app, so schemas, the client and the services can all name the
same states without importing one another (or the model's heavy libraries).
"""

from __future__ import annotations

from enum import StrEnum
from typing import Literal

#: float32: the reference's arithmetic. int8: faster, scores within 0.01 of the reference's
#: (app/embedding/int8_activations.py), on CPUs where int8_support() allows it.
Precision = Literal["float32", "int8"]

#: Why novelty was not measured (it is then the neutral 0.5).
NoveltyReason = Literal[
    "embedder_unavailable", "embedding_failed", "cache_empty", "cache_unavailable"
]

#: Why a trace was not stored in the novelty memory: a dry run; novelty not measured (no
#: vector to store); the shared memory unreachable; its storage refused the write.
NotStoredReason = Literal["dry_run", "not_measured", "cache_unavailable", "storage_failed"]

#: The rule overrides the score can fire.
OverrideName = Literal["single_thought", "error_recovery_bonus", "low_tool_diversity"]

#: Which admission guard turned a request away: the queue's size or the wait for the model.
OverloadReason = Literal["queue_limit", "waited_too_long"]

#: Why an embedding could not be had: no model, or the model failed for these texts.
EmbedderFailure = Literal["embedder_unavailable", "embedding_failed"]

#: Where the novelty cache lives.
BackendKind = Literal["in_process", "redis"]


class EmbedderState(StrEnum):
    DISABLED = "disabled"
    NOT_LOADED = "not_loaded"
    LOADING = "loading"
    READY = "ready"
    UNAVAILABLE = "unavailable"


class StorageState(StrEnum):
    DISABLED = "disabled"
    NONE = "none"  # no database existed yet
    LOADED = "loaded"
    SET_ASIDE = "set_aside"  # unusable file renamed aside; the cache started empty
    ERROR = "error"  # could not read or write; the cache works in memory
    RECOVERED = "recovered"  # a damaged file copied aside; what could be read was kept
    CONVERTED = "converted"  # the former snapshot and journal read into the database
