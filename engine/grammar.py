"""Grammar-constrained tool calls with llguidance.

OpenAI function/tool schemas are validated, rendered into the system prompt in the format the
SmolLM2/Hermes family was trained on (`<tools>...</tools>`, answer as
`<tool_call>[{"name": ..., "arguments": {...}}]</tool_call>`), and compiled with llguidance into a
Lark grammar for exactly one call. Every decode step the grammar's token mask is applied to the
logits; tokens the grammar fully determines are appended without sampling (jump-forward), using
llguidance's canonical tokenization of the forced bytes (`compute_ff_tokens`).

Source: llguidance (guidance-ai/llguidance), Lark grammar with `%json` schema embedding.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["ToolSchemaError", "normalize_tools", "tools_system_prompt", "ToolGrammar", "parse_tool_call"]

_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
# JSON formatting the model sees in the prompt and must produce: ", " and ": " separators.
_JSON_STYLE = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}
CALL_OPEN, CALL_CLOSE = "<tool_call>[", "]</tool_call>"


class ToolSchemaError(ValueError):
    """A tool definition is not a valid OpenAI function schema, or its grammar does not compile.

    The message names the tool and the offending part.
    """


def normalize_tools(tools) -> list[dict]:
    """Validate OpenAI tool definitions and return them as [{"type": "function", "function": {...}}].

    Accepts `{"type": "function", "function": {...}}` or a bare `{"name", "description",
    "parameters"}` per tool.

    Raises:
        ToolSchemaError: not a list, a tool without a valid unique name, parameters that are not
            a JSON-schema object, or a schema llguidance cannot compile.
    """
    if tools is None:
        return []
    if not isinstance(tools, (list, tuple)):
        raise ToolSchemaError(f"tools must be a list of tool definitions, got {type(tools).__name__}")
    out, seen = [], set()
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise ToolSchemaError(f"tools[{i}] must be an object, got {type(tool).__name__}")
        fn = tool.get("function", tool) if tool.get("type", "function") == "function" else None
        if not isinstance(fn, dict):
            raise ToolSchemaError(f"tools[{i}]: type must be 'function' with a 'function' object")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise ToolSchemaError(f"tools[{i}]: name {name!r} must match {_NAME.pattern}")
        if name in seen:
            raise ToolSchemaError(f"tools[{i}]: duplicate tool name {name!r}")
        seen.add(name)
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict) or params.get("type", "object") != "object":
            raise ToolSchemaError(f"tool {name!r}: parameters must be a JSON schema with type 'object'")
        props = params.get("properties", {})
        if not isinstance(props, dict):
            raise ToolSchemaError(f"tool {name!r}: parameters.properties must be an object")
        required = params.get("required", [])
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise ToolSchemaError(f"tool {name!r}: parameters.required must be a list of parameter names")
        for req in required:
            if req not in props:
                raise ToolSchemaError(f"tool {name!r}: required parameter {req!r} is not in properties")
        clean = {"name": name, "description": str(fn.get("description", "")), "parameters": params}
        _check_compiles(name, _call_schema(clean))
        out.append({"type": "function", "function": clean})
    return out


def _call_schema(fn: dict) -> dict:
    params = dict(fn["parameters"])
    params.setdefault("type", "object")
    params.setdefault("additionalProperties", False)
    return {"type": "object", "properties": {"name": {"const": fn["name"]}, "arguments": params},
            "required": ["name", "arguments"], "additionalProperties": False}


def _check_compiles(name: str, schema: dict) -> None:
    import llguidance

    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=_JSON_STYLE)
    except ValueError as exc:
        raise ToolSchemaError(f"tool {name!r}: invalid JSON schema: {exc}") from exc
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise ToolSchemaError(f"tool {name!r}: schema does not compile: {messages[0]}")


def tools_system_prompt(system: str | None, tools: list[dict]) -> str:
    """System prompt text with the tools rendered the way SmolLM2-Instruct was trained for calls."""
    system = system or "You are a helpful assistant."
    if not tools:
        return system
    listing = json.dumps([t["function"] for t in tools], separators=(", ", ": "))
    return (f"{system}\n\nYou have access to the following tools:\n<tools>{listing}</tools>\n\n"
            "To call a tool, answer with exactly one call in this format and no other text:\n"
            '<tool_call>[{"name": "tool_name", "arguments": {"arg": "value"}}]</tool_call>')


def parse_tool_call(text: str) -> dict | None:
    """Parse `<tool_call>[{"name": ..., "arguments": {...}}]</tool_call>` into {"name", "arguments"}."""
    text = text.strip()
    if not (text.startswith(CALL_OPEN) and text.endswith(CALL_CLOSE)):
        return None
    try:
        call = json.loads(text[len(CALL_OPEN):-len(CALL_CLOSE)])
    except json.JSONDecodeError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("arguments"), dict):
        return None
    return {"name": call.get("name"), "arguments": call["arguments"]}


def _parse_tool_choice(tool_choice) -> tuple[str, list[str] | None]:
    """tool_choice -> (mode "required" | "auto", tool names or None for all).

    Raises:
        ToolSchemaError: malformed tool_choice.
    """
    if tool_choice in ("required", "auto"):
        return tool_choice, None
    if isinstance(tool_choice, dict):
        if tool_choice.get("type") == "allowed_tools":
            spec = tool_choice.get("allowed_tools")
            mode = spec.get("mode", "required") if isinstance(spec, dict) else None
            entries = spec.get("tools") if isinstance(spec, dict) else None
            if mode not in ("required", "auto") or not isinstance(entries, list) or not entries:
                raise ToolSchemaError("allowed_tools needs mode 'required' or 'auto' and a non-empty tools list")
            names = [_choice_name(e) if isinstance(e, dict) else e for e in entries]
            if not all(isinstance(n, str) for n in names):
                raise ToolSchemaError(f"allowed_tools.tools must name tools, got {entries!r:.200}")
            return mode, names
        name = _choice_name(tool_choice)
        if isinstance(name, str):
            return "required", [name]
    raise ToolSchemaError(f"tool_choice must be 'auto', 'required', {{'name': ...}} or allowed_tools, "
                          f"got {tool_choice!r:.200}")


def _choice_name(entry: dict):
    """The tool name of {"name": ...} or {"type": "function", "function": {"name": ...}}, or None."""
    fn = entry.get("function", entry)
    return fn.get("name") if isinstance(fn, dict) else None


@dataclass
class ToolGrammar:
    """A compiled grammar for one decision: a tool call (or free text, for tool_choice="auto").

    Create matchers with `matcher()`; each is an `llguidance.LLMatcher` in its start state.
    """

    grammar: str
    ll_tokenizer: object
    vocab_size: int
    mode: str = "required"  # "auto": the answer may be text instead of a call

    @classmethod
    def build(cls, ll_tokenizer, vocab_size: int, tools: list[dict], tool_choice="required") -> "ToolGrammar":
        """Compile the grammar for `tools` (normalized) and `tool_choice`.

        tool_choice: "required" (one call to any tool), "auto" (a call or free text),
        {"name": "..."} or {"type": "function", "function": {"name": "..."}} (that tool), or
        OpenAI's allowed-tools form {"type": "allowed_tools", "allowed_tools": {"mode":
        "required" | "auto", "tools": [{"type": "function", "function": {"name": ...}}, ...]}}
        (one call to one of those tools, e.g. the tools whose preconditions hold now).

        Raises:
            ToolSchemaError: no tools, or tool_choice names an unknown tool or is malformed.
        """
        import llguidance

        if not tools:
            raise ToolSchemaError("decide() needs tools: pass tools=[...] to engine.session()")
        known = {t["function"]["name"]: t for t in tools}
        mode, names = _parse_tool_choice(tool_choice)
        unknown = [n for n in names or () if n not in known]
        if unknown:
            raise ToolSchemaError(f"tool_choice names unknown tool {unknown[0]!r}; known: {list(known)}")
        chosen = [known[n] for n in names] if names else tools
        variants = [_call_schema(t["function"]) for t in chosen]
        schema = {"oneOf": variants} if len(variants) > 1 else variants[0]
        schema["x-guidance"] = dict(_JSON_STYLE, coerce_one_of=True)
        lark = f'call: "{CALL_OPEN}" body "{CALL_CLOSE}"\nbody: %json {json.dumps(schema)}\n'
        if mode == "auto":
            lark = "start: call | text\ntext: /[^<][^\\x00]*/\n" + lark
        else:
            lark = "start: call\n" + lark
        grammar = llguidance.LLMatcher.grammar_from_lark(lark)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, ll_tokenizer)
        if is_error:
            raise ToolSchemaError(f"tool-call grammar does not compile: {messages[0]}")
        return cls(grammar=grammar, ll_tokenizer=ll_tokenizer, vocab_size=vocab_size, mode=mode)

    def matcher(self):
        """A fresh `llguidance.LLMatcher` for this grammar."""
        import llguidance

        return llguidance.LLMatcher(self.ll_tokenizer, self.grammar, log_level=0)


class TokenMask:
    """Reusable bitmask buffer: fills from a matcher and applies to logits in place.

    logits: [1, vocab] fp32. Disallowed ids are set to -inf.
    """

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.bits = torch.zeros((vocab_size + 31) // 32, dtype=torch.int32)

    def allowed(self, matcher) -> torch.Tensor:
        """Bool tensor [vocab] of ids the matcher allows next."""
        matcher.unsafe_compute_mask_ptr(self.bits.data_ptr(), self.bits.numel() * 4)
        unpacked = np.unpackbits(self.bits.numpy().view(np.uint8), bitorder="little")[: self.vocab_size]
        return torch.from_numpy(unpacked.view(np.bool_))

    def apply(self, matcher, logits: torch.Tensor) -> torch.Tensor:
        """Mask `logits` [1, V'] in place (V' may exceed the tokenizer vocab: the rest is masked)."""
        allowed = self.allowed(matcher)
        logits[..., self.vocab_size:] = float("-inf")
        logits[..., : self.vocab_size].masked_fill_(~allowed, float("-inf"))
        return logits
