"""The client's types against the repository's JSON Schemas (`schemas/v1/`), which the producer
validates with and embeds in its OpenAPI document: every typed dictionary has exactly the
schema's properties and required keys, and every enum the client spells equals the schema's.
A change on either side without the other fails here."""

from __future__ import annotations

import json
import typing
from pathlib import Path
from typing import Any

import pytest

from sluice import types

SCHEMAS = Path(__file__).resolve().parents[3] / "schemas" / "v1"


def schema(pointer: str) -> dict[str, Any]:
    """`file.schema.json#/json/pointer`, following one `$ref` to another file's definition."""
    file, _, path = pointer.partition("#")
    node: Any = json.loads((SCHEMAS / file).read_text())
    for part in filter(None, path.split("/")):
        node = node[int(part)] if isinstance(node, list) else node[part]
    if isinstance(node, dict) and "$ref" in node and "properties" not in node:
        ref = node["$ref"]
        return schema(ref if not ref.startswith("#") else file + ref)
    assert isinstance(node, dict)
    return node


SHAPES = [
    (types.TaskStatus, "task-status.schema.json"),
    (types.TaskPage, "task-page.schema.json"),
    (types.Output, "completion.schema.json#/properties/outputs/items"),
    (types.Timings, "completion.schema.json#/properties/timings"),
    (types.TaskError, "completion.schema.json#/properties/error"),
    (types.Progress, "task-status.schema.json#/properties/progress/anyOf/1"),
    (types.ModelInfo, "model-list.schema.json#/properties/models/items"),
    (types.Range, "model-list.schema.json#/$defs/range"),
    (types.CompletionEvent, "completion.schema.json"),
    (types.Source, "dlq.schema.json#/$defs/source"),
    (types.DlqRecord, "dlq.schema.json"),
    (types.OriginalRecord, "dlq.schema.json#/properties/original"),
    (types.WebhookSpec, "webhook.schema.json"),
]


@pytest.mark.parametrize(("shape", "pointer"), SHAPES, ids=[s.__name__ for s, _ in SHAPES])
def test_each_typed_dict_has_the_schemas_keys(shape: Any, pointer: str) -> None:
    node = schema(pointer)
    assert set(shape.__annotations__) == set(node["properties"]), pointer
    assert set(shape.__required_keys__) == set(node.get("required", [])), pointer


def literal(alias: Any) -> set[str]:
    return set(typing.get_args(alias))


def enum(pointer: str) -> set[str]:
    return set(schema(pointer)["enum"])


def test_the_enums_are_the_schemas() -> None:
    assert literal(types.TaskState) == enum("task-status.schema.json#/properties/status")
    assert literal(types.CompletionState) == enum("completion.schema.json#/properties/status")
    assert set(types.TERMINAL_STATES) == literal(types.CompletionState)
    assert literal(types.DlqReason) == enum("dlq.schema.json#/$defs/reason")
    assert literal(types.Sampler) == enum("generation.schema.json#/$defs/generation/properties/sampler")
    assert literal(types.Priority) == enum("generation.schema.json#/$defs/priority")
    assert literal(types.WebhookEvent) == enum("webhook.schema.json#/$defs/event")
    modes = typing.get_args(typing.get_type_hints(types.ModelInfo)["modes"])[0]
    assert literal(modes) == enum("model-list.schema.json#/properties/models/items/properties/modes/items")


def test_submit_fields_are_request_fields() -> None:
    """The keyword arguments `submit` names itself are fields of the request schema."""
    request = schema("task-request.schema.json")
    generation = schema("generation.schema.json#/$defs/generation")
    known = set(request["properties"]) | set(generation["properties"])
    assert {"model", "prompt", "webhook", "deadline", "ttl_seconds", "priority"} <= known
