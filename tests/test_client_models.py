"""The client's models (clients/python, kp_scoring.models) say what the service answers: each
has the fields of the OpenAPI component of the same name, required only where the service
always sends them, so that a field the service adds is a field the client reads."""

from __future__ import annotations

import inspect
import json
from typing import Any

import pytest
from pydantic import BaseModel

from kp_scoring import models
from tests.server import ROOT

COMPONENTS: dict[str, Any] = json.loads(
    (ROOT / "openapi" / "openapi.json").read_text(encoding="utf-8")
)["components"]["schemas"]

MODELS = {
    name: model
    for name, model in inspect.getmembers(models, inspect.isclass)
    if issubclass(model, BaseModel) and model.__module__ == models.__name__ and name in COMPONENTS
}


def test_every_answer_the_client_reads_is_a_component() -> None:
    assert {"EvaluationOut", "NoveltyOut", "NearestOut", "CacheOut", "ReadyOut"} <= set(MODELS)
    own = {
        name
        for name, model in inspect.getmembers(models, inspect.isclass)
        if issubclass(model, BaseModel) and model.__module__ == models.__name__
    }
    assert own - set(MODELS) == {"_Answer"}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_the_model_has_the_components_fields(name: str) -> None:
    component = COMPONENTS[name]
    fields = MODELS[name].model_fields
    assert set(fields) == set(component["properties"])
    # The client may accept less than the service always sends (a field an older service
    # lacks is None), never require what the service may leave out.
    required = {field for field, info in fields.items() if info.is_required()}
    assert required <= set(component.get("required", ()))
