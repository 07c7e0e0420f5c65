"""Grammar-constrained tool calls with llguidance.

OpenAI function/tool schemas are validated, listed in the system prompt (`<tools>...</tools>`) with
the call format of the model's family (`CallFormat`, chosen by `call_format_for` from what the
chat template writes for a tool call: SmolLM2's `<tool_call>[{"name", "arguments"}]</tool_call>`,
Qwen2.5's Hermes `<tool_call>\\n{...}\\n</tool_call>`, Llama 3.x's `{"name", "parameters"}`,
Mistral's `[TOOL_CALLS][{...}]`), and compiled with llguidance into a Lark grammar for one call
(several with parallel calls where the family has them; or free text with tool_choice="auto").
Parameter schemas are prepared by `tokenspeed.schema`. Every decode step the grammar's token mask
is applied to the logits; tokens the grammar fully determines are appended without sampling
(jump-forward), using llguidance's canonical tokenization of the forced bytes (`compute_ff_tokens`).

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
           "AUTO_TOOL_PROMPT",
           "call_schema", "ToolGrammar", "parse_tool_calls", "parse_tool_call", "format_tool_calls", "CallFormat",
           "CALL_FORMATS", "SMOLLM2", "call_format_for", "MAX_CALLS", "complete_tool_calls", "looping_string",
           "looping_structure", "json_closings", "LOOP_REPEATS", "LOOP_MIN_CHARS", "LOOP_MAX_UNIT", "MAX_JSON_DEPTH"]

_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
MAX_CALLS = 8  # calls one answer may hold with parallel calls (the grammar's cap; without them: 1)
# A JSON string in a loop (`looping_string`): its tail is one unit of at most LOOP_MAX_UNIT characters
# written LOOP_REPEATS times or more, over LOOP_MIN_CHARS characters or more (twice that when only
# the unit's numbers change).
LOOP_REPEATS = 3
LOOP_MIN_CHARS = 16
LOOP_MAX_UNIT = 64
# JSON nested deeper than this (objects and arrays) is a runaway (`looping_structure`): no call of the
# BFCL answers or the shipped tool sets nests deeper than 5, markers included.
MAX_JSON_DEPTH = 16
# the shortest JSON values, shortest first: what `json_closings` offers where a value is expected
_SHORT_VALUES = ("0", '""', "[]", "{}", "null", "true", "false")
_STRING_TOKEN = re.compile(r'\\.|"')   # an escape sequence, or a quote that opens or closes a string
_OPEN_UNICODE = re.compile(r'(u[0-9A-Fa-f]{0,3})?\Z')  # after a backslash: an unfinished \\uXXXX escape
_DIGITS = re.compile(r"\d+")
_LETTER = re.compile(r"[A-Za-z]")


@dataclass(frozen=True)
class CallFormat:
    """How a model family writes the tool calls of one assistant turn: `open`, then each call as
    `call_open` + `{"name": ..., <args_key>: {...}}` + `call_close`, separated by `sep`, then `close`.

    Attributes:
        name: "smollm2", "hermes", "llama3" or "mistral" (see `CALL_FORMATS`).
        parallel: the family's template can hold several calls in one turn (Llama 3.x's cannot).
        tags: markers that may be single added/special tokens of the vocabulary (Qwen2.5's
            `<tool_call>`, Mistral's `[TOOL_CALLS]`): the grammar then names the token itself.
    """

    name: str
    open: str = ""
    close: str = ""
    call_open: str = ""
    call_close: str = ""
    sep: str = ""
    args_key: str = "arguments"
    parallel: bool = True
    tags: tuple[str, ...] = ()

    @property
    def first(self) -> str:
        """The first character of every call: a text answer (tool_choice="auto") may not start with it."""
        return (self.open + self.call_open + "{")[0]


# Sources: SmolLM2-Instruct's function-calling prompt (model card); Qwen2.5's and Qwen3's chat
# templates (tests/engine/data/chat_templates); SmolLM3's tool prompt (its Hugging Face template's
# `xml_tools`: Hermes `<tool_call>` calls; the template llama.cpp keeps renders no tools at all);
# Llama 3.1/3.2's template for custom (JSON) tools - its <|python_tag|> is written only for the
# built-in tools (brave_search, wolfram_alpha), which TokenSpeed does not declare, so a custom call
# is the bare JSON; Mistral's v3 tekken template.
CALL_FORMATS = {
    "smollm2": CallFormat("smollm2", open="<tool_call>[", close="]</tool_call>", sep=", ",
                          tags=("<tool_call>", "</tool_call>")),
    "hermes": CallFormat("hermes", call_open="<tool_call>\n", call_close="\n</tool_call>", sep="\n",
                         tags=("<tool_call>", "</tool_call>")),
    "llama3": CallFormat("llama3", args_key="parameters", parallel=False),
    "mistral": CallFormat("mistral", open="[TOOL_CALLS][", close="]", sep=", ", tags=("[TOOL_CALLS]",)),
}


_SMOLLM3_HEADER = "Reasoning Mode: "  # every SmolLM3 template writes it (its tool-less llama.cpp edit too)


def call_format_for(chat_template: str | None) -> CallFormat:
    """The `CallFormat` a chat template writes a tool call in: "[TOOL_CALLS]" -> mistral,
    "<tool_call>" or SmolLM3's "Reasoning Mode: " header -> hermes, `"parameters": ` -> llama3;
    otherwise (no template, or one that writes no tool calls, e.g. SmolLM2's ChatML) smollm2, the
    format SmolLM2 was trained on."""
    t = chat_template or ""
    if "[TOOL_CALLS]" in t:
        return CALL_FORMATS["mistral"]
    if "<tool_call>" in t or _SMOLLM3_HEADER in t:
        return CALL_FORMATS["hermes"]
    if '"parameters": ' in t:
        return CALL_FORMATS["llama3"]
    return CALL_FORMATS["smollm2"]


SMOLLM2 = CALL_FORMATS["smollm2"]


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


def call_schema(functions: list[dict], args_key: str = "arguments") -> dict:
    """The JSON schema of one call object `{"name": ..., <args_key>: {...}}` to any of `functions`.

    functions: the "function" parts of normalized tools. Definitions of every tool are hoisted to
    the root `$defs` (see `tokenspeed.schema.prepare`), so the schema is self-contained.
    args_key: "arguments", or "parameters" (Llama 3.x, `CallFormat.args_key`).
    """
    variants, defs = [], {}
    for fn in functions:
        args = _arguments(fn)
        defs.update(args.defs)
        variants.append({"type": "object", "properties": {"name": {"const": fn["name"]}, args_key: args.schema},
                         "required": ["name", args_key], "additionalProperties": False})
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
                "A call MUST strictly adhere to the following format, with NO other text:\n{example}",
                {"name": "func_name1", "arguments": {"argument1": "value1"}}),
    "short": ("{system}\n\nYou have access to the following tools:\n<tools>{listing}</tools>\n\n"
              "To call a tool, answer with exactly one call in this format and no other text:\n{example}",
              {"name": "tool_name", "arguments": {"arg": "value"}}),
}
DEFAULT_TOOL_PROMPT = "short"
# A call written outside the family's format: bare JSON or a code fence (a Lark regex). Under
# tool_choice "auto" the mass on the first tokens of these is evidence of a call too
# (`ToolGrammar.call_evidence`): where a tool applies, a small model puts much of its call mass on
# "```", "{" or "[" rather than on its own format's "<tool_call>" (`tokenspeed bench auto`).
CALL_LIKE = r"(\{|\[|```)[^\x00]*"
# The listing chat requests with tool_choice "auto" get (`tokenspeed.chat`; serve, LangChain):
# SmolLM2-135M tells "a tool applies" from "none does" better with its own prompt (`tokenspeed
# bench auto --tool-prompt`). "none" gets it too, so that a conversation that alternates "auto"
# and "none" turns stays warm (one system prompt). Decisions (required, named) keep the short one.
AUTO_TOOL_PROMPT = "smollm2"


def tools_system_prompt(system: str | None, tools: list[dict], style: str = DEFAULT_TOOL_PROMPT,
                        fmt: CallFormat = SMOLLM2) -> str:
    """System prompt text with the tools listed in the `style` of `TOOL_PROMPTS` (the system
    text first, then the listing and an example call in the family's format `fmt`).

    Raises:
        ToolSchemaError: unknown style.
    """
    if style not in TOOL_PROMPTS:
        raise ToolSchemaError(f"tool prompt style must be one of {sorted(TOOL_PROMPTS)}, got {style!r}")
    system = system or "You are a helpful assistant."
    if not tools:
        return system
    listing = json.dumps([t["function"] for t in tools], separators=(", ", ": "))
    text, example = TOOL_PROMPTS[style]
    return text.format(system=system, listing=listing, example=format_tool_calls([example], fmt))


def format_tool_calls(calls: list[dict], fmt: CallFormat = SMOLLM2) -> str:
    """The assistant text of `calls` ([{"name", "arguments": dict}]) as the grammar writes it in `fmt`."""
    items = [fmt.call_open + json.dumps({"name": c["name"], fmt.args_key: c["arguments"]}, separators=(", ", ": "))
             + fmt.call_close for c in calls]
    return fmt.open + fmt.sep.join(items) + fmt.close


def parse_tool_calls(text: str, fmt: CallFormat = SMOLLM2) -> list[dict] | None:
    """Parse the calls of an assistant answer written in `fmt` into [{"name", "arguments": dict}].

    Returns None unless the text (surrounding whitespace aside) is exactly a complete call list
    of `fmt` with at least one call (one for a format without parallel calls).
    """
    text = text.strip()
    if not (text.startswith(fmt.open) and text.endswith(fmt.close)) or len(text) < len(fmt.open + fmt.close):
        return None
    inner = text[len(fmt.open):len(text) - len(fmt.close)]
    calls, pos = _scan_calls(inner, fmt)
    return calls if calls and pos == len(inner) else None


def complete_tool_calls(text: str, fmt: CallFormat = SMOLLM2) -> list[dict]:
    """The calls of `fmt` written completely in `text`, the start of an answer that may have been
    cut anywhere (e.g. at max_tokens): [{"name", "arguments": dict}], [] when there is none."""
    text = text.lstrip()
    if not text.startswith(fmt.open):
        return []
    return _scan_calls(text[len(fmt.open):], fmt)[0]


def _scan_calls(inner: str, fmt: CallFormat) -> tuple[list[dict], int]:
    # (the calls written completely at the start of `inner`, the text between `fmt.open` and
    # `fmt.close`; the offset where the scan stopped: after the last call, or where one is malformed)
    calls, pos, decoder = [], 0, json.JSONDecoder()
    while inner.startswith(fmt.call_open, pos):
        try:
            call, end = decoder.raw_decode(inner, pos + len(fmt.call_open))
        except json.JSONDecodeError:
            break
        if not (inner.startswith(fmt.call_close, end) and isinstance(call, dict)
                and isinstance(call.get(fmt.args_key), dict)):
            break
        pos = end + len(fmt.call_close)
        calls.append({"name": call.get("name"), "arguments": call[fmt.args_key]})
        if not fmt.parallel or not inner.startswith(fmt.sep, pos) or pos == len(inner):
            break
        pos += len(fmt.sep)
    return calls, pos


def looping_string(text: str) -> bool:
    """Whether `text`, the start of a JSON answer (a call list in any `CallFormat`: its markers hold
    no quote), ends inside a string that has run into a loop, which only the string's length cap
    (`tokenspeed.schema.MAX_STRING_LENGTH`) would otherwise end, at about max_tokens: the string's
    tail is one unit (1 to `LOOP_MAX_UNIT` characters) written `LOOP_REPEATS` times or more in a
    row, over `LOOP_MIN_CHARS` characters or more. A unit that holds a letter also counts with its
    numbers changing (digit runs compared as one digit: "name_1_to_a_name_2_to_a_name_3_to_a"),
    over twice `LOOP_MIN_CHARS`.
    Seen from SmolLM2-135M under tool_choice="required" on questions no tool applies to (issue 27):
    `"); 1; 2; 3}}]</tool_call> 1. 1. 2. 3. 1. 2. 3. ...` and
    `"A_compound_name_1_to_a_compound_name_2_to_a_compound_name_3_to_a_compound_...`. No string
    of the BFCL questions, answers or the shipped tool sets is a loop by this rule at any prefix.

    Returns False when the text is not inside a string, or inside an unfinished escape sequence
    (a quote there would not end the string).
    """
    if "\\" not in text:  # no escape sequence: the quotes alone say where the last string starts
        start = text.rfind('"') + 1 if text.count('"') % 2 else None
    else:
        start = None
        for m in _STRING_TOKEN.finditer(text):
            if m.group() == '"':
                start = m.end() if start is None else None
    if start is None:
        return False
    value = text[start:][-4 * LOOP_MAX_UNIT * LOOP_REPEATS:]  # a loop shows in its last units
    head = value[:len(value) - len(_OPEN_UNICODE.search(value[-5:]).group())]
    if (len(head) - len(head.rstrip("\\"))) % 2:  # an odd run of backslashes opens an escape sequence
        return False
    near = _DIGITS.sub("0", value)
    return _repeats(value, LOOP_MIN_CHARS) or (near != value and _repeats(near, 2 * LOOP_MIN_CHARS, _LETTER.search))


def _repeats(s: str, min_chars: int, unit_ok=None) -> bool:
    # whether `s` ends in one unit of 1 to LOOP_MAX_UNIT characters (one `unit_ok(unit)` accepts,
    # when given) written LOOP_REPEATS times or more, over `min_chars` characters or more
    end = len(s) - 1
    low = max(0, end - LOOP_MAX_UNIT)
    i = s.rfind(s[-1], low, end) if s else -1
    while i >= 0:  # n: a distance back to the same character, a candidate unit length
        n = end - i
        k = max(LOOP_REPEATS, -(-min_chars // n))
        if k * n <= len(s) and s.endswith(s[-n:], 0, end + 1 - n) and s.endswith(s[-n:] * k) \
                and (unit_ok is None or unit_ok(s[-n:])):
            return True
        i = s.rfind(s[-1], low, i)
    return False


def _deepens(unit: str) -> bool:
    # a unit that opens more objects/arrays than it closes
    return unit.count("{") + unit.count("[") > unit.count("}") + unit.count("]")


def _json_state(text: str) -> tuple[list[str], bool, str]:
    # (open containers "{"/"[" outermost first, inside a string, what comes next outside strings:
    # "value", "key", "colon" or "after" a complete value or key) of the start of a JSON answer;
    # characters outside JSON (a CallFormat's markers) are skipped
    stack, in_string, escape, expect = [], False, False, "value"
    for c in text:
        if in_string:
            if escape:
                escape = False
            elif c == "\\":
                escape = True
            elif c == '"':
                in_string = False
                expect = "colon" if expect == "key" else "after"
        elif c == '"':
            in_string = True
        elif c in "{[":
            stack.append(c)
            expect = "key" if c == "{" else "value"
        elif c in "}]":
            if stack:
                stack.pop()
            expect = "after"
        elif c == ":":
            expect = "value"
        elif c == ",":
            expect = "key" if stack and stack[-1] == "{" else "value"
        elif not c.isspace() and expect == "value":
            expect = "after"  # a number or literal
    return stack, in_string, expect


def looping_structure(text: str) -> bool:
    """Whether `text`, the start of a JSON answer (as for `looping_string`), has run away outside
    its strings, which only `max_tokens` would otherwise end: it nests deeper than `MAX_JSON_DEPTH`,
    or its tail (not inside a string) is one unit of at most `LOOP_MAX_UNIT` characters, opening
    more objects/arrays than it closes, written `LOOP_REPEATS` times or more in a row over
    `LOOP_MIN_CHARS` characters or more.
    Seen from SmolLM2-135M under response_format json_object (issue 27):
    `{"name": "Felix", "age": 10, "looks": {"cat": {"name": "Felix", "looks": {"cat": {"name": ...`.
    No call of the BFCL answers or the shipped tool sets is one at any prefix.
    """
    stack, in_string, _ = _json_state(text)
    if in_string:
        return False
    if len(stack) > MAX_JSON_DEPTH:
        return True
    return _repeats(text.rstrip()[-LOOP_MAX_UNIT * LOOP_REPEATS:], LOOP_MIN_CHARS, _deepens)


def json_closings(text: str) -> list[str]:
    """The shortest texts that end `text`, the start of a JSON answer, as complete JSON: close an
    open string, give an expected value (each of the shortest values, `_SHORT_VALUES`, in turn: a
    grammar allows some of them) or key (`""` with a value), then close every open array and object.
    Candidates, most preferred first; the caller keeps the first its grammar accepts.
    """
    stack, in_string, expect = _json_state(text)
    close = "".join("}" if c == "{" else "]" for c in reversed(stack))
    head = '"' if in_string else ""
    if in_string:
        expect = "colon" if expect == "key" else "after"
    if expect == "after" or (expect == "key" and text.rstrip().endswith("{")) or \
            (expect == "value" and text.rstrip().endswith("[")):
        return [head + close]
    lead = {"key": '"": ', "colon": ": "}.get(expect, "")
    return [head + lead + v + close for v in _SHORT_VALUES]


def parse_tool_call(text: str, fmt: CallFormat = SMOLLM2) -> dict | None:
    """The first call of `parse_tool_calls(text, fmt)` ({"name", "arguments"}), or None."""
    calls = parse_tool_calls(text, fmt)
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
        call_start: "auto" only: [vocab] bool (host), the ids that open a call (the first mask of
            the same grammar without its text branch), for `tokenspeed.auto.AutoRule`; else None.
        call_evidence: "auto" only: [vocab] bool (host), `call_start` and the ids that open a call
            written another way (`CALL_LIKE`: bare JSON, a code fence), whose probability mass
            `AutoRule` weighs; else None.
    """

    grammar: str
    ll_tokenizer: object
    vocab_size: int
    mode: str = "required"
    call_start: torch.Tensor | None = None
    call_evidence: torch.Tensor | None = None

    @classmethod
    def build(cls, ll_tokenizer, vocab_size: int, tools: list[dict], tool_choice="required",
              parallel: bool = False, fmt: CallFormat = SMOLLM2) -> "ToolGrammar":
        """Compile the grammar for `tools` (normalized) and `tool_choice`.

        tool_choice: "required" (a call to any tool), "auto" (a call or free text),
        {"name": "..."} or {"type": "function", "function": {"name": "..."}} (that tool), or
        OpenAI's allowed-tools form {"type": "allowed_tools", "allowed_tools": {"mode":
        "required" | "auto", "tools": [{"type": "function", "function": {"name": ...}}, ...]}}
        (a call to one of those tools, e.g. the tools whose preconditions hold now).
        parallel: the answer may hold several calls (`<tool_call>[{...}, {...}]</tool_call>`), at
            most `MAX_CALLS`, where the format has them (`CallFormat.parallel`; Llama 3.x: one call).
        fmt: the family's call format (`call_format_for`); a marker of `fmt.tags` that is one
            special/added token of the vocabulary is matched as that token (llguidance lexes
            special tokens apart from text, so the literal would never match it).

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
        schema = call_schema(chosen, fmt.args_key)
        schema["x-guidance"] = dict(JSON_STYLE, coerce_one_of=True)

        def lit(text: str) -> str:  # a Lark sequence writing `text`, its single-token tags as tokens
            parts = []
            for piece in re.split("(" + "|".join(map(re.escape, fmt.tags)) + ")", text) if fmt.tags else [text]:
                ids = ll_tokenizer.tokenize_str(piece) if piece in fmt.tags else []
                if len(ids) == 1 and ll_tokenizer.is_special_token(ids[0]):
                    parts.append(f"<[{ids[0]}]>")
                elif piece:
                    parts.append(json.dumps(piece))
            return " ".join(parts)

        one = " ".join(filter(None, [lit(fmt.call_open), "item", lit(fmt.call_close)]))
        body = f"body: one ({lit(fmt.sep)} one){{0,{MAX_CALLS - 1}}}\n" if parallel and fmt.parallel else "body: one\n"
        call = " ".join(filter(None, [lit(fmt.open), "body", lit(fmt.close)]))
        lark = f"call: {call}\n{body}one: {one}\nitem: %json {json.dumps(schema)}\n"
        call_only = _compile_lark("start: call\n" + lark, ll_tokenizer, "tool-call grammar")
        if mode != "auto":
            return cls(call_only, ll_tokenizer, vocab_size, mode)
        import llguidance

        def first(grammar: str) -> torch.Tensor:  # the ids `grammar` allows first
            return TokenMask(vocab_size).allowed(llguidance.LLMatcher(ll_tokenizer, grammar, log_level=0)).clone()

        call_start = first(call_only)
        evidence = call_start | first(_compile_lark(f"start: /{CALL_LIKE}/\n", ll_tokenizer, "call-like text"))
        text = f"text: /[^{re.escape(fmt.first)}\\x00][^\\x00]*/\n"
        return cls(_compile_lark(f"start: call | text\n{text}" + lark, ll_tokenizer, "tool-call grammar"), ll_tokenizer,
                   vocab_size, mode, call_start, evidence)

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
    """Grammar masks in llguidance's packed bitmask format: int32 words, bit `i % 32` of word `i // 32`
    set when token i is allowed. The matcher computes them on the host; `apply` masks logits on their
    device (on CUDA the words go up from pinned host memory, copied non-blocking).

    Args:
        vocab_size: the tokenizer's vocabulary (logits may be wider: the ids past it are masked).
        device: the model's device, where `apply` masks logits.
        executor: the `llguidance.LLExecutor` that computes a chain's masks in one call (None: a
            one-thread executor of this mask's own).
    """

    def __init__(self, vocab_size: int, device: "str | torch.device" = "cpu", executor=None):
        import llguidance

        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.n_words = (vocab_size + 31) // 32
        self._executor = executor if executor is not None else llguidance.LLExecutor(1)
        self._bits = torch.zeros(self.n_words, dtype=torch.int32, device="cpu")  # `allowed`'s host words
        self._chain = torch.zeros((0, self.n_words), dtype=torch.int32, device="cpu")  # `fill_chain`'s rows
        self._shifts = torch.arange(32, dtype=torch.int32, device=self.device)

    def allowed(self, matcher) -> torch.Tensor:
        """Bool tensor [vocab] (host) of the ids the matcher allows next."""
        matcher.unsafe_compute_mask_ptr(self._bits.data_ptr(), self.n_words * 4)
        return self.unpacked(self._bits)

    def unpacked(self, words: torch.Tensor) -> torch.Tensor:
        """Bool tensor [vocab] (host) of one row of packed words [n_words] int32 (host)."""
        unpacked = np.unpackbits(words.numpy().view(np.uint8), bitorder="little")[: self.vocab_size]
        return torch.from_numpy(unpacked.view(np.bool_))

    def fill_chain(self, matcher, chain: list[int]) -> torch.Tensor:
        """The masks [len(chain) + 1, n_words] int32 (host; pinned on CUDA) of the matcher's states
        along `chain`: row r is the mask after chain[:r] (llguidance's
        `unsafe_compute_mask_ptr_with_draft_token`, one call). The matcher is left as it was; rows
        after a token the grammar rejects, or after the grammar stops, are not written. The rows
        are overwritten by the next call."""
        n = len(chain) + 1
        if self._chain.shape[0] < n:
            self._chain = torch.zeros((max(n, 16), self.n_words), dtype=torch.int32, device="cpu",
                                      pin_memory=self.device.type == "cuda")
        rows = self._chain[:n]
        if chain:
            self._executor.unsafe_compute_mask_ptr_with_draft_token([(matcher, 0, list(chain))], rows.data_ptr(),
                                                                    self.n_words * 4, n)
        else:
            matcher.unsafe_compute_mask_ptr(rows.data_ptr(), self.n_words * 4)
        return rows

    def apply(self, logits: torch.Tensor, words: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Mask `logits` [R, V'] in place on their device: logit [i, t] becomes -inf unless bit t of
        `words[rows[i]]` is set (V' may exceed the vocabulary: the ids past it are masked).

        Args:
            logits: [R, V'] fp32 on the model's device.
            words: [N, n_words] int32 packed masks (host, e.g. `fill_chain`'s rows).
            rows: [R] int64 indices into `words` on the logits' device (None: words has R rows).
        """
        dev = words.to(logits.device, non_blocking=True)
        if rows is not None:
            dev = dev.index_select(0, rows)
        allowed = ((dev.unsqueeze(-1) >> self._shifts) & 1).view(len(dev), -1)[:, : self.vocab_size].bool()
        logits[:, self.vocab_size:] = float("-inf")
        logits[:, : self.vocab_size].masked_fill_(~allowed, float("-inf"))
        return logits
