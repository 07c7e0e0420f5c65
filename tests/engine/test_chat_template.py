"""The session takes the assistant turn's framing from the model's own chat template, not from ChatML.

The second template has the shape of Mistral's (`[INST] ... [/INST]`, the answer ended by the eos
token); it is written here because no model files can be fetched, and the embedded model's
tokenizer stands in for Mistral's.
"""
import json
import shutil

import tokenspeed
from tokenspeed.tokenizer import Tokenizer
from tokenspeed.weights import resolve_model

MISTRAL_SHAPED = ("{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
                  "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
                  "{{ ' ' + message['content'] + eos_token }}{% else %}{{ message['content'] + '\\n\\n' }}{% endif %}"
                  "{% endfor %}")


def test_smollm2_template_gives_chatml_framing(tiny_engine):
    tok = tiny_engine.tokenizer
    assert (tok.assistant_prefix, tok.assistant_suffix) == ("<|im_start|>assistant\n", "<|im_end|>\n")
    assert tok.stop_ids == [tok.eos_id]  # <|im_end|> is SmolLM2's eos


def test_another_template_frames_the_answer_its_way(tiny_engine, robot_tools, tmp_path):
    src = resolve_model(None).folder
    shutil.copy(src / "tokenizer.json", tmp_path / "tokenizer.json")
    cfg = json.loads((src / "tokenizer_config.json").read_text()) | {"chat_template": MISTRAL_SHAPED}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = Tokenizer(tmp_path)
    eos = tok.decode([tok.eos_id])
    assert (tok.assistant_prefix, tok.assistant_suffix) == (" ", eos)
    engine = tokenspeed.Engine(tiny_engine.model, tok, "tiny-random, Mistral-shaped template")
    session = engine.session(system="You control a robot arm.", tools=robot_tools)
    session.observe("Pick up the red cube.")
    d = session.decide(tool_choice={"name": "hold"}, max_tokens=80)
    assert d.status == "ok", d.reason
    context = tok.decode(session.tokens + session.pending)
    assert context.endswith(f"[INST] Pick up the red cube. [/INST] {d.text}{eos}") and "<|im_start|>" not in context
