"""JSON schemas of tool parameters and structured responses, made ready for the grammar.

Agent frameworks send JSON Schema as Pydantic writes it: `$defs`/`definitions` with local
`$ref`s, `anyOf`/`oneOf`, OpenAPI's `nullable`, `enum`/`const`, `pattern`, `format`,
`minItems`/`maxItems` and `default`. The tool-call grammar nests a tool's parameters under
`properties.arguments` of the call object, so references are rewritten to point at definitions
hoisted to the root of the grammar's schema (prefixed per tool, so two tools' `Pose` never
collide). What llguidance cannot enforce is refused with the path of the offending part; nothing
is silently widened. Objects that list `properties` and say nothing of `additionalProperties`
get `additionalProperties: false` (OpenAI's strict mode does the same): a narrowing, never a
widening.

Values a schema leaves unbounded are bounded here, so that no answer can run on inside one value
(a small model may repeat a string, an array item or a digit until `max_tokens`): a number gets
`minimum`/`maximum` of -/+`NUMBER_LIMIT` where the schema gives none (at most 15 integer digits),
a non-integer number `multipleOf` `NUMBER_STEP` where it gives none (at most 6 decimals), a string
`maxLength` `MAX_STRING_LENGTH` and an array `maxItems` `MAX_ARRAY_ITEMS` where it gives none;
enum/const values are left as they are. Narrowings, never widenings.

Source: JSON Schema 2020-12 (`$ref`, `$defs`), OpenAPI 3.0 (`nullable`), llguidance's JSON
schema support (guidance-ai/llguidance, docs/json_schema.md).
"""
from __future__ import annotations

import copy
import json

__all__ = ["ToolSchemaError", "Prepared", "prepare", "compile_check", "NUMBER_LIMIT", "NUMBER_STEP",
           "MAX_STRING_LENGTH", "MAX_ARRAY_ITEMS"]

# JSON formatting the model sees in the prompt and must produce: ", " and ": " separators.
JSON_STYLE = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}
_DEF_KEYS = ("$defs", "definitions")
# Bounds given to values a schema leaves unbounded (`_bound`): no value can run to max_tokens.
NUMBER_LIMIT = 10 ** 15 - 1   # |number| at most this: 15 integer digits
NUMBER_STEP = 1e-6            # a non-integer number is a multiple of this: at most 6 decimals
MAX_STRING_LENGTH = 256       # characters of a string without maxLength
MAX_ARRAY_ITEMS = 16          # items of an array without maxItems
# Sub-schema positions walked when rewriting and when locating an error: (keyword, kind).
_MAP_KEYS = ("properties", "$defs", "definitions", "patternProperties")
_LIST_KEYS = ("anyOf", "oneOf", "allOf", "prefixItems")
_ONE_KEYS = ("items", "additionalProperties", "not", "contains")


class ToolSchemaError(ValueError):
    """A tool definition or response schema is invalid, or asks for what the grammar cannot enforce.

    The message names the tool (or response format) and the path of the offending part.
    """


class Prepared:
    """A schema rewritten for embedding in a larger grammar schema.

    Attributes:
        schema: the schema, its `$ref`s pointing at `#/$defs/<prefix><name>`.
        defs: definitions to place under the root `$defs` of the grammar's schema.
    """

    def __init__(self, schema: dict, defs: dict):
        self.schema = schema
        self.defs = defs


def prepare(schema: dict, prefix: str, where: str) -> Prepared:
    """Rewrite `schema` so it can sit anywhere inside a grammar schema whose root holds `defs`.

    Args:
        schema: a JSON schema (not modified).
        prefix: prepended to every definition name (e.g. "pick." for tool pick).
        where: names the schema in errors (e.g. "tool 'pick' parameters").
    Returns:
        a `Prepared` (schema and hoisted definitions).
    Raises:
        ToolSchemaError: a `$ref` that is not local (`#...`), or points at nothing.
    """
    schema = copy.deepcopy(schema)
    defs: dict = {}
    for key in _DEF_KEYS:
        for name, sub in (schema.pop(key, None) or {}).items():
            defs[f"{prefix}{name}"] = sub
    root_key = f"{prefix}$root"
    needs_root = []

    def ref(target: str, path: str) -> str:
        if not target.startswith("#"):
            raise ToolSchemaError(f"{where}: {path.lstrip('.') or 'the schema'}: only local references ('#/$defs/...') are supported, "
                                  f"got {target!r}")
        pointer = target[1:]
        for key in _DEF_KEYS:
            head = f"/{key}/"
            if pointer.startswith(head):
                name, _, rest = pointer[len(head):].partition("/")
                if f"{prefix}{name}" not in defs:
                    raise ToolSchemaError(f"{where}: {path.lstrip('.') or 'the schema'}: $ref {target!r} points at no definition")
                return f"#/$defs/{prefix}{name}" + (f"/{rest}" if rest else "")
        needs_root.append(True)  # "#" or "#/properties/...": the schema itself becomes a definition
        return f"#/$defs/{root_key}{pointer}"

    def walk(node, path: str):
        if not isinstance(node, dict):
            return node
        if node.pop("nullable", False) is True:
            rest = dict(node)
            node.clear()
            node["anyOf"] = [walk(rest, path), {"type": "null"}]
            return node
        if isinstance(node.get("$ref"), str):
            node["$ref"] = ref(node["$ref"], path)
        _check_enum(node, path, where)
        _bound(node)
        if "properties" in node and "additionalProperties" not in node:
            node["additionalProperties"] = False
        for key in _MAP_KEYS:
            if isinstance(node.get(key), dict):
                for name, sub in node[key].items():
                    walk(sub, f"{path}.{name}" if key == "properties" else f"{path}.{key}.{name}")
        for key in _LIST_KEYS:
            if isinstance(node.get(key), list):
                for i, sub in enumerate(node[key]):
                    walk(sub, f"{path}.{key}[{i}]")
        for key in _ONE_KEYS:
            walk(node.get(key), f"{path}[]" if key == "items" else f"{path}.{key}")
        return node

    schema = walk(schema, "")
    for name, sub in defs.items():
        walk(sub, f"$defs.{name[len(prefix):]}")
    if needs_root:
        defs[root_key] = schema
        schema = {"$ref": f"#/$defs/{root_key}"}
    return Prepared(schema, defs)


def _bound(node: dict) -> None:
    # The caps of the module docstring, on a node that declares its type(s) and no enum/const.
    kinds = node.get("type")
    kinds = {kinds} if isinstance(kinds, str) else set(kinds) if isinstance(kinds, list) else set()
    if not kinds or "enum" in node or "const" in node:
        return
    if kinds & {"number", "integer"}:
        low = _number(node.get("minimum", node.get("exclusiveMinimum")))
        high = _number(node.get("maximum", node.get("exclusiveMaximum")))
        if low is None and "minimum" not in node and "exclusiveMinimum" not in node:
            node["minimum"] = low = min(-NUMBER_LIMIT, high if high is not None else 0)
        if high is None and "maximum" not in node and "exclusiveMaximum" not in node:
            node["maximum"] = max(NUMBER_LIMIT, low if low is not None else 0)
        if "number" in kinds and "multipleOf" not in node:
            node["multipleOf"] = NUMBER_STEP
    if "string" in kinds and "maxLength" not in node:
        node["maxLength"] = max(MAX_STRING_LENGTH, _number(node.get("minLength")) or 0)
    if "array" in kinds and "maxItems" not in node:
        node["maxItems"] = max(MAX_ARRAY_ITEMS, _number(node.get("minItems")) or 0)


def _number(value):
    # value when it is a number (not a bool), else None
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


_JSON_TYPES = {"string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,), "array": (list,),
               "object": (dict,), "null": (type(None),)}


def _has_type(value, kind: str) -> bool:
    if isinstance(value, bool) and kind in ("integer", "number"):
        return False
    return isinstance(value, _JSON_TYPES.get(kind, object))


def _check_enum(node: dict, path: str, where: str) -> None:
    # An enum/const none of whose values has the declared type accepts nothing: llguidance would
    # compile it and the decoder would dead-end inside the call.
    values = node["enum"] if isinstance(node.get("enum"), list) else [node["const"]] if "const" in node else None
    kinds = node.get("type")
    if values is None or kinds is None:
        return
    kinds = [kinds] if isinstance(kinds, str) else kinds
    if not any(_has_type(v, k) for v in values for k in kinds):
        raise ToolSchemaError(f"{where}: {path.lstrip('.') or 'the schema'}: no enum/const value has type "
                              f"{'/'.join(kinds)}; nothing could satisfy it")


def compile_check(schema: dict, where: str) -> None:
    """Compile `schema` with llguidance; on failure name the deepest part that does not compile.

    Raises:
        ToolSchemaError: the schema is invalid or unenforceable; the message names `where`, the
            property path (e.g. `target.pose.x`, `joints[]`) and llguidance's reason.
    """
    error = _compile_error(schema)
    if error is None:
        return
    path, reason = _locate(schema, schema.get("$defs", {}), "", error)
    raise ToolSchemaError(f"{where}: {path or 'the schema'}: {reason}")


def _compile_error(schema: dict) -> str | None:
    import llguidance

    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_STYLE)
    except ValueError as exc:
        return str(exc)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    return messages[0] if is_error else None


def _locate(node: dict, defs: dict, path: str, error: str) -> tuple[str, str]:
    # Depth-first: the deepest sub-schema that fails on its own (with the root's definitions).
    children = []
    for key in ("properties", "$defs"):
        if isinstance(node.get(key), dict):
            children += [(f"{path}.{n}" if key == "properties" else f"$defs.{n}", s) for n, s in node[key].items()]
    for key in _LIST_KEYS:
        if isinstance(node.get(key), list):
            children += [(f"{path}.{key}[{i}]", s) for i, s in enumerate(node[key])]
    for key in _ONE_KEYS:
        if isinstance(node.get(key), dict):
            children.append((f"{path}[]" if key == "items" else f"{path}.{key}", node[key]))
    for child_path, child in children:
        if not isinstance(child, dict):
            return child_path.lstrip("."), f"not a schema object: {json.dumps(child)[:60]}"
        sub = dict(child, **({"$defs": defs} if defs else {}))
        sub_error = _compile_error(sub)
        if sub_error is not None:
            return _locate(child, defs, child_path, sub_error)
    return path.lstrip("."), error
