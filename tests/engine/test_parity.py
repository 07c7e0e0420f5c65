"""Correctness against Hugging Face transformers on the real SmolLM2-135M-Instruct.

The reference is transformers' own GGUF loader (its dequantization, Q/K un-permutation and
tokenizer conversion), so these tests check TokenSpeed's conversion as well as its model.

Tolerance: fp32 on CPU (an fp32 KV cache here: the engine's default fp16 one moves logits by up to
~0.03, its decisions are checked in test_cpu_decode), different kernels and summation order;
observed max |diff| ~5e-5 on logits of magnitude ~40. We assert max |diff| < 2e-3 and identical argmax.
"""
import pytest
import torch

from tokenspeed.bfcl import load_bfcl
from tokenspeed.grammar import tools_system_prompt, normalize_tools
from tokenspeed.weights import default_model_path

LOGIT_ATOL = 2e-3
N_NEW = 64

ROBOT_PROMPTS = [
    "The red cube is at x=0.42 y=-0.10 on the table. Pick it up.",
    "Joint positions: [0.0, -0.3, 0.0, -2.1, 0.0, 1.9, 0.8]. Is the arm near its home pose?",
    "Place the green cube at x=0.55, y=0.20.",
    "The gripper force reads 12 N while holding the blue cube. What should the robot do?",
    "Describe in one sentence how a robot arm picks up a cube.",
    "Camera: red_cube (0.42,-0.10), green_cube (0.55,0.12), blue_cube (0.61,-0.20). Which cube is closest to the robot base?",
    "Stop the arm immediately, a person entered the workspace.",
    "BTC/USD mid 64210.5, spread 1.2, imbalance 0.35. Should a market maker buy or sell?",
    "Write a short JSON object with keys x and y for the point (0.4, 0.1).",
    "List three safety rules for collaborative robots.",
]


def _prompts():
    texts = [[{"role": "user", "content": p}] for p in ROBOT_PROMPTS]
    for case in load_bfcl("heldout")[:12]:  # BFCL prompts with their tool schema in the system prompt
        system = tools_system_prompt("You are a function-calling assistant.", normalize_tools(case["tools"]))
        texts.append([{"role": "system", "content": system}] + case["messages"])
    return texts


PROMPTS = _prompts()


@pytest.fixture(scope="module")
def hf():
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    path = default_model_path()
    tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                              dtype=torch.float32)
    return tok, model.eval()


def test_enough_prompts():
    assert len(PROMPTS) >= 20


@pytest.mark.parametrize("i", range(len(PROMPTS)))
def test_tokenizer_matches_transformers(engine, hf, i):
    text = engine.tokenizer.render_chat(PROMPTS[i], add_generation_prompt=True)
    assert engine.tokenizer.encode(text) == hf[0](text, add_special_tokens=False)["input_ids"]
    assert text == hf[0].apply_chat_template(PROMPTS[i], tokenize=False, add_generation_prompt=True)


@pytest.mark.parametrize("i", range(len(PROMPTS)))
def test_logits_and_greedy_match_transformers(engine, hf, i):
    tok = engine.tokenizer
    ids = tok.encode(tok.render_chat(PROMPTS[i], add_generation_prompt=True))
    model = engine.model
    cache = model.new_cache(len(ids) + N_NEW + 1, dtype=torch.float32)
    logits = model(torch.tensor(ids), torch.arange(len(ids)), cache, "last")[0]
    out = []
    for _ in range(N_NEW):  # TokenSpeed greedy decode, one token per forward
        out.append(int(logits.argmax()))
        logits = model(torch.tensor(out[-1:]), torch.tensor([cache.n]), cache, "last")[0]
    with torch.no_grad():
        ref = hf[1](torch.tensor([ids + out])).logits[0]
    ours_last = model(torch.tensor(ids), torch.arange(len(ids)), model.new_cache(len(ids), dtype=torch.float32),
                      "last")[0]
    assert (ours_last - ref[len(ids) - 1]).abs().max().item() < LOGIT_ATOL
    # Greedy parity: transformers' argmax at every position of TokenSpeed's sequence is the
    # token TokenSpeed chose, so transformers' greedy decode produces exactly this sequence.
    ref_choice = ref[len(ids) - 1: len(ids) - 1 + N_NEW].argmax(-1).tolist()
    assert ref_choice == out
