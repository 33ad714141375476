"""mkdocs hook: the configuration page's settings, rendered from `app.core.config.Settings`.

Each field becomes a section named after its variable (`KP_<NAME>`) with its type, its
default, its bounds and its `description`, so the page cannot drift from the code.
tests/test_docs_site.py checks that every field has a description and is on the built page.
"""

from __future__ import annotations

import enum
import types
import typing
from pathlib import Path
from typing import Any

MARKER = "<!-- settings -->"


def _type_name(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return " \\| ".join(f"`{value}`" for value in typing.get_args(annotation))
    if origin is typing.Annotated:
        return _type_name(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        parts = [a for a in typing.get_args(annotation) if a is not type(None)]
        return " \\| ".join(_type_name(a) for a in parts)
    names = {
        bool: "boolean (`true`, `false`)",
        int: "integer",
        float: "number",
        str: "string",
        Path: "file path",
    }
    if annotation in names:
        return names[annotation]
    if getattr(annotation, "__name__", "") == "SecretStr":
        return "string (secret: never logged or shown)"
    return getattr(annotation, "__name__", str(annotation))


def _default(value: Any) -> str:
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return f"`{value}`"


def _constraints(field: Any) -> list[Any]:
    """The field's own constraints, and those of an `Annotated[...] | None` it is declared as."""
    found = list(field.metadata)
    for member in typing.get_args(field.annotation):
        if typing.get_origin(member) is typing.Annotated:
            for item in getattr(member, "__metadata__", ()):
                found += list(getattr(item, "metadata", [item]))  # a Field(...) holds its own
    return found


def _bounds(field: Any) -> str:
    words = {
        "ge": ">=",
        "gt": ">",
        "le": "<=",
        "lt": "<",
        "min_length": "length >=",
        "max_length": "length <=",
        "pattern": "matches",
    }
    found = []
    for item in _constraints(field):
        for attribute, word in words.items():
            value = getattr(item, attribute, None)
            if value is None:
                continue
            if attribute == "pattern":
                shown = f"`{value}`"
            elif isinstance(value, int):
                shown = f"{value:,}"
            else:
                shown = str(value)
            found.append(f"{word} {shown}")
    return ", ".join(found)


def env_name(field_name: str) -> str:
    from app.core.config import ENV_PREFIX

    return f"{ENV_PREFIX}{field_name.upper()}"


def render() -> str:
    """Markdown: a summary table, then one section per setting, in the class's order."""
    from app.core.config import Settings

    rows = ["| variable | default |", "|---|---|"]
    sections = []
    for name, field in Settings.model_fields.items():
        variable = env_name(name)
        rows.append(f"| [`{variable}`](#{variable.lower()}) | {_default(field.default)} |")
        facts = [
            f"**Type:** {_type_name(field.annotation)}",
            f"**Default:** {_default(field.default)}",
        ]
        bounds = _bounds(field)
        if bounds:
            facts.append(f"**Bounds:** {bounds}")
        sections.append(f"### {variable}\n\n{' · '.join(facts)}\n\n{field.description or ''}\n")
    return "\n".join(rows) + "\n\n" + "\n".join(sections)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    if page.file.src_uri != "configuration.md":
        return markdown
    return markdown.replace(MARKER, render())
