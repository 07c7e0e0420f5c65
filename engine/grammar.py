"""Grammar-constrained tool calls with llguidance.

OpenAI function/tool schemas are validated, rendered into the system prompt in the format the
SmolLM2/Hermes family was trained on (`<tools>...</tools>`, answer as
`<tool_call>[{"name": ..., "arguments": {...}}]</tool_call>`), and compiled with llguidance into a
Lark grammar for one call (several in the list with parallel calls; or free text with
tool_choice="auto"). Parameter schemas are prepared by `tokenspeed.schema`. Every decode step the grammar's token mask is applied to the
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

from .schema import JSON_STYLE, Prepared, ToolSchemaError, compile_check, prepare

__all__ = ["ToolSchemaError", "normalize_tools", "tools_system_prompt", "TOOL_PROMPTS", "DEFAULT_TOOL_PROMPT",
           "call_schema", "ToolGrammar", "parse_tool_calls", "parse_tool_call", "format_tool_calls"]

_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
CALL_OPEN, CALL_CLOSE = "<tool_call>[", "]</tool_call>"


def normalize_tools(tools) -> list[dict]:
    """Validate OpenAI tool definitions and return them as [{"type": "function", "function": {...}}].

    Accepts `{"type": "function", "function": {...}}` or a bare `{"name", "description",
    "parameters"}` per tool. Parameter schemas may use everything `tokenspeed.schema` accepts
    (`$defs`/`$ref`, `anyOf`/`oneOf`, `nullable`, `enum`/`const`, `pattern`, `format`, ...).

    Raises:
        ToolSchemaError: not a list, a tool without a valid unique name, parameters that are not
            a JSON-schema object, or a schema llguidance cannot enforce (the message names the
            tool and the property path).
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
        params = fn.get("parameters") or {"type": "object", "properties": {}}
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
        clean = {"name": name, "description": str(fn.get("description") or ""), "parameters": params}
        args = _arguments(clean)
        compile_check(dict(args.schema, **({"$defs": args.defs} if args.defs else {})), f"tool {name!r}")
        out.append({"type": "function", "function": clean})
    return out


def _arguments(fn: dict) -> Prepared:
    params = dict(fn["parameters"])
    params.setdefault("type", "object")
    params.setdefault("additionalProperties", False)
    return prepare(params, f"{fn['name']}.", f"tool {fn['name']!r}")


def call_schema(functions: list[dict]) -> dict:
    """The JSON schema of one call object `{"name": ..., "arguments": {...}}` to any of `functions`.

    functions: the "function" parts of normalized tools. Definitions of every tool are hoisted to
    the root `$defs` (see `tokenspeed.schema.prepare`), so the schema is self-contained.
    """
    variants, defs = [], {}
    for fn in functions:
        args = _arguments(fn)
        defs.update(args.defs)
        variants.append({"type": "object", "properties": {"name": {"const": fn["name"]}, "arguments": args.schema},
                         "required": ["name", "arguments"], "additionalProperties": False})
    schema = {"oneOf": variants} if len(variants) > 1 else variants[0]
    return dict(schema, **({"$defs": defs} if defs else {}))


# Tool-listing prompts, by name: how the tools and the call format are put in the system prompt.
# "smollm2" follows the function-calling prompt SmolLM2-Instruct was fine-tuned with (SmolLM2
# model card, Synth-APIGen data: "You are an expert in composing functions ... <tools>...</tools>
# ... <tool_call>[...]</tool_call>"), except that "no call" is a plain-text answer here, never an
# empty list. "short" is a two-line listing. `tokenspeed bench auto` compares them on BFCL.
TOOL_PROMPTS = {
    "smollm2": ("{system}\n\nYou are an expert in composing functions. You are given a question and a set of "
                "possible functions. Based on the question, you will need to make one or more function/tool "
                "calls to achieve the purpose. If none of the functions can be used, answer in plain text "
                "without a call.\n\nYou have access to the following tools:\n<tools>{listing}</tools>\n\n"
                "A call MUST strictly adhere to the following format, with NO other text:\n"
                '<tool_call>[{{"name": "func_name1", "arguments": {{"argument1": "value1"}}}}]</tool_call>'),
    "short": ("{system}\n\nYou have access to the following tools:\n<tools>{listing}</tools>\n\n"
              "To call a tool, answer with exactly one call in this format and no other text:\n"
              '<tool_call>[{{"name": "tool_name", "arguments": {{"arg": "value"}}}}]</tool_call>'),
}
DEFAULT_TOOL_PROMPT = "short"


def tools_system_prompt(system: str | None, tools: list[dict], style: str = DEFAULT_TOOL_PROMPT) -> str:
    """System prompt text with the tools listed in the `style` of `TOOL_PROMPTS` (the system
    text first, then the listing and the call format).

    Raises:
        ToolSchemaError: unknown style.
    """
    if style not in TOOL_PROMPTS:
        raise ToolSchemaError(f"tool prompt style must be one of {sorted(TOOL_PROMPTS)}, got {style!r}")
    system = system or "You are a helpful assistant."
    if not tools:
        return system
    listing = json.dumps([t["function"] for t in tools], separators=(", ", ": "))
    return TOOL_PROMPTS[style].format(system=system, listing=listing)


def format_tool_calls(calls: list[dict]) -> str:
    """The assistant text of `calls` ([{"name", "arguments": dict}]) as the grammar writes it."""
    body = ", ".join(json.dumps({"name": c["name"], "arguments": c["arguments"]}, separators=(", ", ": "))
                     for c in calls)
    return f"{CALL_OPEN}{body}{CALL_CLOSE}"


def parse_tool_calls(text: str) -> list[dict] | None:
    """Parse `<tool_call>[{"name": ..., "arguments": {...}}, ...]</tool_call>` into [{"name", "arguments"}].

    Returns None unless the text is exactly one complete call list with at least one call.
    """
    text = text.strip()
    if not (text.startswith(CALL_OPEN) and text.endswith(CALL_CLOSE)):
        return None
    try:
        calls = json.loads(text[len(CALL_OPEN) - 1:-len(CALL_CLOSE) + 1])
    except json.JSONDecodeError:
        return None
    if not calls or not all(isinstance(c, dict) and isinstance(c.get("arguments"), dict) for c in calls):
        return None
    return [{"name": c.get("name"), "arguments": c["arguments"]} for c in calls]


def parse_tool_call(text: str) -> dict | None:
    """The first call of `parse_tool_calls(text)` ({"name", "arguments"}), or None."""
    calls = parse_tool_calls(text)
    return calls[0] if calls else None


def parse_tool_choice(tool_choice) -> tuple[str, list[str] | None]:
    """tool_choice -> (mode "required" | "auto" | "none", tool names or None for all).

    Raises:
        ToolSchemaError: malformed tool_choice.
    """
    if tool_choice in ("required", "auto", "none"):
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
    raise ToolSchemaError("tool_choice must be 'auto', 'required', 'none', {'name': ...} or allowed_tools, "
                          f"got {tool_choice!r:.200}")


def _choice_name(entry: dict):
    """The tool name of {"name": ...} or {"type": "function", "function": {"name": ...}}, or None."""
    fn = entry.get("function", entry)
    return fn.get("name") if isinstance(fn, dict) else None


@dataclass
class ToolGrammar:
    """A compiled grammar for one answer: tool call(s), text or a call (auto), or JSON (response format).

    Create matchers with `matcher()`; each is an `llguidance.LLMatcher` in its start state.

    Attributes:
        mode: "required" (call(s) only), "auto" (call(s) or free text; the first token settles
            which: text may not start with "<"), or "json" (one JSON value of a response schema).
    """

    grammar: str
    ll_tokenizer: object
    vocab_size: int
    mode: str = "required"

    @classmethod
    def build(cls, ll_tokenizer, vocab_size: int, tools: list[dict], tool_choice="required",
              parallel: bool = False) -> "ToolGrammar":
        """Compile the grammar for `tools` (normalized) and `tool_choice`.

        tool_choice: "required" (a call to any tool), "auto" (a call or free text),
        {"name": "..."} or {"type": "function", "function": {"name": "..."}} (that tool), or
        OpenAI's allowed-tools form {"type": "allowed_tools", "allowed_tools": {"mode":
        "required" | "auto", "tools": [{"type": "function", "function": {"name": ...}}, ...]}}
        (a call to one of those tools, e.g. the tools whose preconditions hold now).
        parallel: the answer may hold several calls (`<tool_call>[{...}, {...}]</tool_call>`).

        Raises:
            ToolSchemaError: no tools, tool_choice "none" (no grammar: free text), or names an
                unknown tool or is malformed.
        """
        if not tools:
            raise ToolSchemaError("decide() needs tools: pass tools=[...] to engine.session()")
        known = {t["function"]["name"]: t for t in tools}
        mode, names = parse_tool_choice(tool_choice)
        if mode == "none":
            raise ToolSchemaError('tool_choice="none" answers in free text and has no call grammar')
        unknown = [n for n in names or () if n not in known]
        if unknown:
            raise ToolSchemaError(f"tool_choice names unknown tool {unknown[0]!r}; known: {list(known)}")
        chosen = [known[n]["function"] for n in names] if names else [t["function"] for t in tools]
        schema = call_schema(chosen)
        schema["x-guidance"] = dict(JSON_STYLE, coerce_one_of=True)
        item = f"item: %json {json.dumps(schema)}\n"
        body = 'body: item (", " item)*\n' if parallel else "body: item\n"
        lark = f'call: "{CALL_OPEN}" body "{CALL_CLOSE}"\n{body}{item}'
        lark = ("start: call | text\ntext: /[^<][^\\x00]*/\n" if mode == "auto" else "start: call\n") + lark
        return cls(_compile_lark(lark, ll_tokenizer, "tool-call grammar"), ll_tokenizer, vocab_size, mode)

    @classmethod
    def json_response(cls, ll_tokenizer, vocab_size: int, schema: dict) -> "ToolGrammar":
        """Compile the grammar of one JSON value valid under `schema` (OpenAI's response_format json_schema).

        Raises:
            ToolSchemaError: the schema is invalid or unenforceable (the message names the path).
        """
        if not isinstance(schema, dict):
            raise ToolSchemaError(f"response_format: json_schema.schema must be an object, got {type(schema).__name__}")
        prepared = prepare(schema, "", "response_format")
        full = dict(prepared.schema, **({"$defs": prepared.defs} if prepared.defs else {}))
        compile_check(full, "response_format")
        full["x-guidance"] = dict(JSON_STYLE, coerce_one_of=True)
        lark = f"start: %json {json.dumps(full)}\n"
        return cls(_compile_lark(lark, ll_tokenizer, "response_format"), ll_tokenizer, vocab_size, "json")

    def matcher(self):
        """A fresh `llguidance.LLMatcher` for this grammar."""
        import llguidance

        return llguidance.LLMatcher(self.ll_tokenizer, self.grammar, log_level=0)


def _compile_lark(lark: str, ll_tokenizer, what: str) -> str:
    import llguidance

    grammar = llguidance.LLMatcher.grammar_from_lark(lark)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, ll_tokenizer)
    if is_error:
        raise ToolSchemaError(f"{what} does not compile: {messages[0]}")
    return grammar


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
