"""The session takes the assistant turn's framing and the tool-call format from the model's own chat
template, not from ChatML.

Every supported family is tested with its real template (tests/engine/data/chat_templates/, sources
in the README there) on a tiny random model: the embedded tokenizer plus that family's special
tokens, 2 layers of random weights built as `Engine.load("tiny-random")` builds them.
"""
import json
from pathlib import Path

import llguidance
import pytest
from tokenizers import AddedToken
from tokenizers import Tokenizer as HFTokenizer

import tokenspeed
from tokenspeed.grammar import ToolGrammar, call_format_for, format_tool_calls, normalize_tools, parse_tool_calls
from tokenspeed.model import ModelArgs
from tokenspeed.engine import _tiny_random
from tokenspeed.tokenizer import Tokenizer, grammar_tokenizer, write_grammar_tokens
from tokenspeed.weights import resolve_model

TEMPLATES = Path(__file__).parent / "data" / "chat_templates"
LLAMA3 = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"]
# template file -> (the family's special tokens, eos token, expected assistant prefix, expected suffix)
MISTRAL = "mistralai-Mistral-Nemo-Instruct-2407"
QWEN3, SMOLLM3 = "Qwen-Qwen3-0.6B", "HuggingFaceTB-SmolLM3-3B"
CHATML = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
FAMILIES = {
    "Qwen-Qwen2.5-7B-Instruct": (CHATML, "<|im_end|>", "<|im_start|>assistant\n", "<|im_end|>\n"),
    # non-thinking mode (enable_thinking=False): an empty reasoning block opens every answer
    QWEN3: (CHATML, "<|im_end|>", "<|im_start|>assistant\n<think>\n\n</think>\n\n", "<|im_end|>\n"),
    SMOLLM3: (CHATML, "<|im_end|>", "<|im_start|>assistant\n<think>\n\n</think>\n", "<|im_end|>\n"),
    "meta-llama-Llama-3.1-8B-Instruct": (LLAMA3, "<|eot_id|>", "<|start_header_id|>assistant<|end_header_id|>\n\n",
                                         "<|eot_id|>"),
    "meta-llama-Llama-3.2-3B-Instruct": (LLAMA3, "<|eot_id|>", "<|start_header_id|>assistant<|end_header_id|>\n\n",
                                         "<|eot_id|>"),
    "mistralai-Mistral-Nemo-Instruct-2407": (["<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]",
                                              "[/AVAILABLE_TOOLS]", "[TOOL_CALLS]", "[TOOL_RESULTS]",
                                              "[/TOOL_RESULTS]"], "</s>", "", "</s>"),
}
# Templates that render a message the same way whatever follows it (Mistral's puts the system
# prompt into the last user message instead: test_mistral_writes_the_system_prompt_once; Qwen3's
# drops the reasoning block of answers before the last question: test_qwen3_keeps_the_empty_reasoning_block).
PREFIX_STABLE = ["Qwen-Qwen2.5-7B-Instruct", "meta-llama-Llama-3.1-8B-Instruct", "meta-llama-Llama-3.2-3B-Instruct",
                 SMOLLM3]


def family_tokenizer(folder: Path, name: str, call_tags: bool = False) -> Tokenizer:
    """The embedded tokenizer plus the family's special tokens, with its real chat template
    (call_tags: Qwen2.5's `<tool_call>`/`</tool_call>` added tokens too)."""
    specials, eos = FAMILIES[name][:2]
    hf = HFTokenizer.from_file(str(resolve_model(None).folder / "tokenizer.json"))
    hf.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    if call_tags:  # Qwen2.5's call tags are added tokens, not special ones (its tokenizer.json)
        hf.add_tokens([AddedToken(t, special=False, normalized=False) for t in ("<tool_call>", "</tool_call>")])
    hf.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": eos, "chat_template": (TEMPLATES / f"{name}.jinja").read_text()}))
    return Tokenizer(folder)


def tiny_engine_for(tok: Tokenizer, name: str) -> tokenspeed.Engine:
    """A 2-layer random-weight model over `tok`'s vocabulary (the one Engine.load("tiny-random") builds)."""
    return tokenspeed.Engine(_tiny_random(ModelArgs(vocab_size=tok.vocab_size)), tok, f"tiny-random, {name} template")


def test_smollm2_template_gives_chatml_framing(tiny_engine):
    tok = tiny_engine.tokenizer
    assert (tok.assistant_prefix, tok.assistant_suffix) == ("<|im_start|>assistant\n", "<|im_end|>\n")
    assert tok.stop_ids == [tok.eos_id]  # <|im_end|> is SmolLM2's eos


@pytest.mark.parametrize("name", list(FAMILIES))
def test_each_family_frames_the_answer_its_own_way(name, tmp_path):
    tok = family_tokenizer(tmp_path, name)
    _, eos, prefix, suffix = FAMILIES[name]
    assert (tok.assistant_prefix, tok.assistant_suffix) == (prefix, suffix)
    assert [tok.decode([i]) for i in tok.stop_ids] == [eos]


@pytest.mark.parametrize("name", PREFIX_STABLE)
def test_session_context_is_the_templates_own_rendering(name, tmp_path, robot_tools):
    tok = family_tokenizer(tmp_path, name)
    session = tiny_engine_for(tok, name).session(system="You control a robot arm.", tools=robot_tools)
    session.observe("Pick up the red cube.")
    d = session.decide(tool_choice={"name": "hold"}, max_tokens=80)
    assert d.status == "ok", d.reason
    session.observe("Now place it.")
    conversation = [{"role": "system", "content": session._system_text},
                    {"role": "user", "content": "Pick up the red cube."},
                    {"role": "assistant", "content": d.text},
                    {"role": "user", "content": "Now place it."}]
    assert tok.decode(session.tokens + session.pending) == tok.render_chat(conversation)
    assert "<|im_start|>" not in tok.decode(session.tokens + session.pending) or FAMILIES[name][0] == CHATML


# template -> the call format it writes (tokenspeed.grammar.CALL_FORMATS)
FORMATS = {"Qwen-Qwen2.5-7B-Instruct": "hermes", "meta-llama-Llama-3.1-8B-Instruct": "llama3",
           "meta-llama-Llama-3.2-3B-Instruct": "llama3", MISTRAL: "mistral", QWEN3: "hermes", SMOLLM3: "hermes"}


@pytest.mark.parametrize("name", list(FAMILIES))
def test_each_family_writes_and_parses_calls_its_own_way(name, tmp_path, robot_tools):
    tok = family_tokenizer(tmp_path, name, call_tags=name.startswith("Qwen"))
    fmt = call_format_for(tok.chat_template)
    assert fmt.name == FORMATS[name]
    calls = [{"name": "pick", "arguments": {"object": "red_cube"}}, {"name": "hold", "arguments": {}}]
    calls = calls if fmt.parallel else calls[:1]  # Llama 3.x's template refuses several calls in one turn
    # What the family's template itself writes for an assistant turn with these calls parses back to them
    # (Mistral's adds the call ids its template requires and sorts keys: the parser takes that too).
    probe = [{"role": "user", "content": "ping"}]
    head = tok.render_chat(probe, add_generation_prompt=True)
    answer = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "abcdefghi", "type": "function", "function": c} for c in calls]}
    if name == SMOLLM3:  # its template renders no tool_calls: the calls are the answer's text, as the model wrote them
        answer = {"role": "assistant", "content": format_tool_calls(calls, fmt)}
    turn = tok.render_chat(probe + [answer])
    assert turn.startswith(head) and turn.endswith(tok.assistant_suffix)
    written = turn[len(head):len(turn) - len(tok.assistant_suffix)]
    assert parse_tool_calls(written, fmt) == calls, written
    assert parse_tool_calls(format_tool_calls(calls, fmt), fmt) == calls
    if name != MISTRAL:  # Qwen's and Llama's templates write exactly what the grammar writes
        assert format_tool_calls(calls, fmt) == written
    # The grammar constrains the answer to that format; the decision parses it back.
    session = tiny_engine_for(tok, name).session(system="You control a robot arm.", tools=robot_tools)
    session.observe("Pick up the red cube.")
    d = session.decide(tool_choice={"name": "pick"}, max_tokens=80)
    assert d.status == "ok" and d.tool_call["name"] == "pick", d.reason
    assert d.text == format_tool_calls(d.tool_calls, fmt)
    assert d.openai_message(["call_1"])["tool_calls"][0]["function"]["name"] == "pick"
    for tag in fmt.tags:  # a marker that is one special/added token is written as that token
        tag_id = tok.encode(tag)
        if len(tag_id) == 1 and tag in d.text:
            assert tag_id[0] in session.tokens + session.pending
    session.observe("Now place it.")  # auto: a call or text, never a failure (Mistral: no answer header)
    assert session.decide(tool_choice="auto", max_tokens=8).status in ("ok", "text")


def test_qwen3_keeps_the_empty_reasoning_block(tmp_path, robot_tools):
    # Non-thinking mode: the answer opens with the empty <think> block (the generation prompt of
    # enable_thinking=False), then the grammar's call. Qwen3's template writes that block only for
    # answers after the last question, so once the conversation goes on the session's context (which
    # cannot rewrite cached tokens) keeps it where a fresh rendering of the history would drop it.
    tok = family_tokenizer(tmp_path, QWEN3, call_tags=True)
    session = tiny_engine_for(tok, QWEN3).session(system="You control a robot arm.", tools=robot_tools)
    session.observe("Pick up the red cube.")
    d = session.decide(tool_choice={"name": "hold"}, max_tokens=80)
    assert d.status == "ok" and d.text == '<tool_call>\n{"name": "hold", "arguments": {}}\n</tool_call>', d.reason
    system = session._system_text
    conversation = [{"role": "system", "content": system}, {"role": "user", "content": "Pick up the red cube."},
                    {"role": "assistant", "content": d.text}]
    assert tok.decode(session.tokens + session.pending) == tok.render_chat(conversation)
    assert tok.decode(session.tokens + session.pending).endswith(f"<think>\n\n</think>\n\n{d.text}<|im_end|>\n")
    session.observe("Now place it.")
    context = tok.decode(session.tokens + session.pending)
    later = tok.render_chat([*conversation, {"role": "user", "content": "Now place it."}])
    assert context == later.replace("<|im_start|>assistant\n<tool_call>",
                                    "<|im_start|>assistant\n<think>\n\n</think>\n\n<tool_call>")


def test_qwen_call_with_its_own_tool_call_token(tmp_path, robot_tools):
    # Qwen2.5's <tool_call> is an added token, which llguidance treats as special: the grammar names it
    # as a token (a literal "<tool_call>" would never match it).
    name = "Qwen-Qwen2.5-7B-Instruct"
    tok = family_tokenizer(tmp_path, name, call_tags=True)
    session = tiny_engine_for(tok, name).session(system="You control a robot arm.", tools=robot_tools)
    session.observe("Pick up the red cube.")
    for jump_forward in (True, False):
        cp = session.checkpoint()
        d = session.decide(tool_choice={"name": "hold"}, max_tokens=80, jump_forward=jump_forward)
        assert d.status == "ok", d.reason
        assert d.text == '<tool_call>\n{"name": "hold", "arguments": {}}\n</tool_call>'
        assert tok.encode("<tool_call>")[0] in session.tokens + session.pending
        session.rollback(cp)


@pytest.mark.parametrize("name", [None, "Qwen-Qwen2.5-7B-Instruct"])
def test_grammar_tokenizer_from_the_cache_is_llguidances_own(name, tmp_path, monkeypatch, robot_tools):
    # The embedded tokenizer, and a Qwen2.5-shaped one (ChatML specials, <tool_call> added tokens): the
    # grammar tokenizer built from the cached token bytes is the one llguidance builds from tokenizer.json.
    monkeypatch.setenv("TOKENSPEED_CACHE", str(tmp_path / "cache"))
    tok = Tokenizer(resolve_model(None).folder) if name is None else family_tokenizer(tmp_path, name, call_tags=True)
    wrapped = []
    monkeypatch.setattr(llguidance, "TokenizerWrapper",
                        lambda v, real=llguidance.TokenizerWrapper: wrapped.append(v) or real(v))
    native = llguidance.LLTokenizer(tok.json, n_vocab=tok.vocab_size, eos_token=tok.eos_id)
    first = grammar_tokenizer(tok)
    assert len(wrapped) == 1  # first build: the bytes from the text, entry written, the wrapped one returned
    assert len(list((tmp_path / "cache" / "grammar_tokens").iterdir())) == 1
    cached = grammar_tokenizer(tok)
    assert len(wrapped) == 2  # from the entry
    assert all(first.decode_bytes([i]) == cached.decode_bytes([i]) for i in range(cached.vocab_size))
    assert (cached.vocab_size, cached.eos_token, cached.is_canonical) == (native.vocab_size, native.eos_token,
                                                                          native.is_canonical)
    for i in range(native.vocab_size):
        assert cached.decode_bytes([i]) == native.decode_bytes([i]), i
        assert cached.is_special_token(i) == native.is_special_token(i), i
    texts = ["<tool_call>\n{\"name\": \"hold\"}\n</tool_call>", "<|im_end|>\n<|im_start|>assistant", "x=0.42 y=-0.10",
             "Déjà vu: 12345 naïve 👋 日本語", "  \n\t  trailing  ", ""]
    for text in texts:
        for special in (False, True):
            assert cached.tokenize_str(text, parse_special=special) == native.tokenize_str(text, parse_special=special)
    # the same masks along a call
    fmt = call_format_for(tok.chat_template)
    tools = normalize_tools(robot_tools)
    matchers = [ToolGrammar.build(ll, tok.vocab_size, tools, "required", False, fmt).matcher() for ll in (native, cached)]
    ids = tok.encode(format_tool_calls([{"name": "hold", "arguments": {}}], fmt))
    for t in ids:
        assert matchers[0].compute_bitmask() == matchers[1].compute_bitmask()
        assert all(m.consume_token(t) for m in matchers)


def test_write_grammar_tokens_makes_the_entry_the_grammar_tokenizer_reads(tmp_path, monkeypatch):
    # what Engine.load does before the weights: llguidance's build from the text happens there, once;
    # the grammar tokenizer is then built from the entry (wrapped), never from the text again
    monkeypatch.setenv("TOKENSPEED_CACHE", str(tmp_path / "cache"))
    tok = Tokenizer(resolve_model(None).folder)
    built = []
    monkeypatch.setattr(llguidance, "LLTokenizer",
                        lambda source, *a, real=llguidance.LLTokenizer, **k: built.append(source) or real(source, *a, **k))
    write_grammar_tokens(tok)
    assert built == [tok.json] and len(list((tmp_path / "cache" / "grammar_tokens").iterdir())) == 1
    write_grammar_tokens(tok)
    assert len(built) == 1  # the entry exists: nothing built
    assert grammar_tokenizer(tok).vocab_size == tok.vocab_size
    assert len(built) == 2 and not isinstance(built[1], str)  # from the entry, through llguidance's TokenizerWrapper


def test_a_changed_or_damaged_tokenizer_never_hits_a_stale_grammar_entry(tmp_path, monkeypatch):
    # Qwen2.5's tokenizer without and with its <tool_call> added tokens: one entry each, each its own bytes;
    # a truncated entry is built again from the text and rewritten.
    monkeypatch.setenv("TOKENSPEED_CACHE", str(tmp_path / "cache"))
    entries = tmp_path / "cache" / "grammar_tokens"
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    plain = family_tokenizer(tmp_path / "a", "Qwen-Qwen2.5-7B-Instruct")
    tagged = family_tokenizer(tmp_path / "b", "Qwen-Qwen2.5-7B-Instruct", call_tags=True)
    for tok in (plain, tagged, plain, tagged):
        ids = tok.encode("<tool_call>")
        assert grammar_tokenizer(tok).tokenize_str("<tool_call>") == ids
        assert grammar_tokenizer(tok).is_special_token(ids[0]) == (tok is tagged)
    assert len(list(entries.iterdir())) == 2
    (entry,) = [e for e in entries.iterdir() if e.stat().st_size == max(f.stat().st_size for f in entries.iterdir())]
    whole = entry.read_bytes()
    entry.write_bytes(whole[:-7])
    assert grammar_tokenizer(tagged).decode_bytes(tagged.encode("<tool_call>")) == b"<tool_call>"
    assert entry.read_bytes() == whole


def test_mistral_writes_the_system_prompt_once(tmp_path, robot_tools):
    # Mistral's template writes the system prompt (and so the tool listing) with the LAST user
    # message. A warm session cannot move cached tokens, and repeating it each turn would re-prefill
    # it: the session writes it once, with the first user message - the one deliberate difference
    # from the template's rendering of the whole conversation (identical for a single turn).
    tok = family_tokenizer(tmp_path, MISTRAL)
    assert tok.system_moves and not family_tokenizer(tmp_path, "Qwen-Qwen2.5-7B-Instruct").system_moves
    tok = family_tokenizer(tmp_path, MISTRAL)
    session = tiny_engine_for(tok, MISTRAL).session(system="You control a robot arm.", tools=robot_tools)
    system = session._system_text
    session.observe("Pick up the red cube.")
    first_turn = tok.decode(session.tokens + session.pending)
    assert first_turn == tok.render_chat([{"role": "system", "content": system},
                                          {"role": "user", "content": "Pick up the red cube."}])
    d = session.decide(tool_choice={"name": "hold"}, max_tokens=80)
    assert d.status == "ok", d.reason
    session.observe("Now place it.")
    context = tok.decode(session.tokens + session.pending)
    assert context.count(system) == 1
    assert context == tok.render_chat([{"role": "user", "content": f"{system}\n\nPick up the red cube."},
                                       {"role": "assistant", "content": d.text},
                                       {"role": "user", "content": "Now place it."}])
    assert context != tok.render_chat([{"role": "system", "content": system},
                                       {"role": "user", "content": "Pick up the red cube."},
                                       {"role": "assistant", "content": d.text},
                                       {"role": "user", "content": "Now place it."}])


def test_mistral_answer_ends_with_its_eos(tmp_path, robot_tools):
    name = MISTRAL
    tok = family_tokenizer(tmp_path, name)
    session = tiny_engine_for(tok, name).session(system="You control a robot arm.", tools=robot_tools)
    session.observe("Pick up the red cube.")
    d = session.decide(tool_choice={"name": "hold"}, max_tokens=80)
    assert d.status == "ok", d.reason
    context = tok.decode(session.tokens + session.pending)
    assert context.endswith(f"Pick up the red cube.[/INST]{d.text}</s>") and "<|im_start|>" not in context


def test_a_template_refusal_is_a_clear_error(tmp_path):
    tok = family_tokenizer(tmp_path, "mistralai-Mistral-Nemo-Instruct-2407")
    with pytest.raises(ValueError, match="chat template: .*alternate"):
        tok.render_chat([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
