"""Tool and response schemas as agent frameworks send them (Pydantic `$defs`, anyOf, nullable, ...).

Accepted schemas must yield calls that validate against the original schema (checked with
jsonschema) on a tiny random model, whose choices are arbitrary: only the grammar keeps them valid.
Refused schemas must name the offending property path.
"""
import jsonschema
import pytest

from tokenspeed import ToolSchemaError
from tokenspeed.grammar import call_schema, normalize_tools

# Integers are bounded: a random model would otherwise write digits until max_tokens.
INT = {"type": "integer", "minimum": -99, "maximum": 99}
POSE = {"type": "object", "properties": {"x": INT, "y": INT}, "required": ["x", "y"]}

ACCEPTED = {
    "$defs (Pydantic)": {"$defs": {"Pose": POSE}, "type": "object",
                         "properties": {"target": {"$ref": "#/$defs/Pose"}}, "required": ["target"]},
    "definitions": {"definitions": {"Pose": POSE}, "type": "object",
                    "properties": {"target": {"$ref": "#/definitions/Pose"}}, "required": ["target"]},
    "recursive $ref": {"$defs": {"Node": {"type": "object", "properties": {
        "v": INT, "kids": {"type": "array", "items": {"$ref": "#/$defs/Node"}, "maxItems": 1}},
        "required": ["v"]}}, "type": "object", "properties": {"tree": {"$ref": "#/$defs/Node"}}, "required": ["tree"]},
    "$ref into the parameters": {"type": "object", "properties": {"a": {"type": "string", "maxLength": 5},
                                                                  "b": {"$ref": "#/properties/a"}}, "required": ["b"]},
    "anyOf": {"type": "object", "properties": {"v": {"anyOf": [{"type": "string", "maxLength": 4}, INT]}}, "required": ["v"]},
    "oneOf": {"type": "object", "properties": {"v": {"oneOf": [{"type": "boolean"}, INT]}},
              "required": ["v"]},
    "nullable (OpenAPI)": {"type": "object", "properties": {"v": dict(INT, nullable=True)},
                           "required": ["v"]},
    "type list with null": {"type": "object", "properties": {"v": dict(INT, type=["integer", "null"])}, "required": ["v"]},
    "enum and const": {"type": "object", "properties": {"v": {"enum": ["left", "right"]}, "c": {"const": 3}},
                       "required": ["v", "c"]},
    "pattern": {"type": "object", "properties": {"v": {"type": "string", "pattern": "^[a-z]{2}[0-9]{2}$"}},
                "required": ["v"]},
    "format": {"type": "object", "properties": {"d": {"type": "string", "format": "date"},
                                                "u": {"type": "string", "format": "uuid"}}, "required": ["d", "u"]},
    "minItems/maxItems": {"type": "object", "properties": {"v": {"type": "array", "items": INT,
                                                                 "minItems": 2, "maxItems": 3}}, "required": ["v"]},
    "default and bounds": {"type": "object", "properties": {"v": {"type": "integer", "default": 3, "minimum": 0,
                                                                  "maximum": 9}}, "required": ["v"]},
}

REFUSED = {
    "array with a string enum": ({"type": "object", "properties": {"arm": {"type": "object", "properties": {
        "joints": {"type": "array", "enum": ["a", "b"]}}}}}, "arm.joints"),
    "unknown format": ({"type": "object", "properties": {"when": {"type": "string", "format": "stardate"}}}, "when"),
    "look-ahead pattern": ({"type": "object", "properties": {"v": {"type": "string", "pattern": "^(?=a)a+$"}}}, "v"),
    "uniqueItems": ({"type": "object", "properties": {"ids": {"type": "array", "uniqueItems": True}}}, "ids"),
    "not": ({"type": "object", "properties": {"v": {"not": {"type": "string"}}}}, "v"),
    "remote $ref": ({"type": "object", "properties": {"v": {"$ref": "https://example.com/s.json"}}}, "v"),
    "dangling $ref": ({"type": "object", "properties": {"v": {"$ref": "#/$defs/Nope"}}}, "v"),
}


def _tool(params, name="act"):
    return {"type": "function", "function": {"name": name, "description": "", "parameters": params}}


@pytest.mark.parametrize("params", ACCEPTED.values(), ids=ACCEPTED.keys())
def test_accepted_schemas_give_valid_calls(tiny_engine, params):
    session = tiny_engine.session(tools=[_tool(params)])
    session.observe("Act now.")
    d = session.decide(max_tokens=160)
    assert d.status == "ok", d.reason
    jsonschema.validate(d.tool_call["arguments"], params)


@pytest.mark.parametrize("params,path", REFUSED.values(), ids=REFUSED.keys())
def test_refusals_name_the_property_path(params, path):
    with pytest.raises(ToolSchemaError, match=f"tool 'act': {path}:"):
        normalize_tools([_tool(params)])


def test_same_definition_name_in_two_tools_does_not_collide():
    other = {"$defs": {"Pose": {"type": "object", "properties": {"deg": {"type": "integer"}}, "required": ["deg"]}},
             "type": "object", "properties": {"p": {"$ref": "#/$defs/Pose"}}, "required": ["p"]}
    tools = normalize_tools([_tool(ACCEPTED["$defs (Pydantic)"], "move"), _tool(other, "turn")])
    schema = call_schema([t["function"] for t in tools])
    assert set(schema["$defs"]) == {"move.Pose", "turn.Pose"}
    jsonschema.validate({"name": "turn", "arguments": {"p": {"deg": 3}}}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "turn", "arguments": {"p": {"x": 1, "y": 2}}}, schema)


def test_response_format_schema(tiny_engine):
    schema = {"$defs": {"Pose": POSE}, "type": "object", "properties": {"goal": {"$ref": "#/$defs/Pose"},
                                                                        "note": {"type": "string", "maxLength": 8}},
              "required": ["goal", "note"]}
    session = tiny_engine.session()
    session.observe("Where to?")
    pieces = []
    d = session.decide(response_format=schema, max_tokens=120, on_text=pieces.append)
    assert d.status == "text", d.reason
    assert "".join(pieces) == d.text  # streamed pieces include the grammar-forced closing tokens
    import json
    jsonschema.validate(json.loads(d.text), schema)
    with pytest.raises(ToolSchemaError, match="response_format: v:"):
        session.decide(response_format={"type": "object", "properties": {"v": {"not": {}}}})
