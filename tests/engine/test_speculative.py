"""Speculative decoding: lossless greedy output, KV bookkeeping, rejection sampling distribution.

Real SmolLM2-135M for greedy equivalence (robot tool calls, BFCL held-out calls, free text);
a tiny small-vocabulary Llama for the sampling-distribution test, where the exact target
distribution can be enumerated.
"""
import itertools
import json
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

import tokenspeed
from tokenspeed.bfcl import load_bfcl
from tokenspeed.model import ModelArgs, Transformer, rope_tables
from tokenspeed.decode import Target, decode
from tokenspeed.speculation import (AdaptiveLength, DraftModel, ForcedText, MessageMatch, PromptLookup, SpecConfig,
                                    Speculator, copy_source)

ROOT = Path(__file__).resolve().parents[2]
ROBOT_TOOLS = json.loads((ROOT / "engine/data/tools/robot_tools.json").read_text())
SYSTEM = ("You control a Franka Panda robot arm above a table with a red, a green and a blue cube. "
          "Reply with exactly one tool call that moves the task forward.")
ROBOT_PROMPTS = [
    "The red cube is at x=0.42 y=-0.10 on the table. Pick it up.",
    "Move the gripper to x=0.5, y=0.1, z=0.2.",
    "Place the held cube at x=0.55 y=0.05.",
    "Stop now, a person entered the cell!",
    "objects blue_cube=(0.61,0.20) green_cube=(0.35,-0.22). Pick the green cube.",
    "Move above x=0.45 y=-0.15 at height z=0.30.",
    "Put the cube down at x=0.38, y=0.21.",
    "Hold position until the camera is clean.",
    "The blue cube is at x=0.61 y=0.20. Pick the blue cube.",
    "Move the gripper to x=0.62, y=-0.05, z=0.12.",
    "Place it at x=0.47 y=-0.27.",
    "joints q=[0.00,-0.79,0.00,-2.36,0.00,1.57,0.79] (rad). Pick the red cube at x=0.51 y=0.02.",
]
TEXT_PROMPTS = ["Name three colours.", "What is 12 + 30?", "Say hello to the robot.",
                "Write the word 'cube' twice.", "Count from 1 to 5."]


@pytest.fixture(scope="module")
def engine():
    return tokenspeed.Engine.load(quantize=None)


def rejecting_config(engine) -> SpecConfig:
    """Prompt lookup plus an untrained draft at a fixed k: many acceptances and many rejections."""
    vocab = torch.arange(0, 8192)
    draft = DraftModel.init_from_target(engine.model, vocab, n_layers=1, hidden_dim=256)
    return SpecConfig(draft=draft, max_k=4, adaptive=False, min_ngram=1)


def _decisions(engine, config, prompts, tools, system):
    engine.speculation = config
    s = engine.session(system=system, tools=tools)
    cp = s.checkpoint()
    out = []
    for p in prompts:
        s.rollback(cp)
        s.observe(p)
        out.append(s.decide(max_tokens=64))
    return out


def _outputs(engine, config):
    """(decisions on the robot and BFCL prompts, generate() texts) under one speculation config."""
    decisions = _decisions(engine, config, ROBOT_PROMPTS, ROBOT_TOOLS, SYSTEM)
    for case in load_bfcl("heldout")[:3]:
        decisions += _decisions(engine, config, [case["messages"][0]["content"]], case["tools"], None)
    engine.speculation = config
    s = engine.session()
    texts = []
    for p in TEXT_PROMPTS:
        cp = s.checkpoint()
        texts.append(s.generate(p, max_tokens=10))
        s.rollback(cp)
    return decisions, texts


def _assert_same(engine, config):
    saved = engine.speculation
    try:
        plain, plain_texts = _outputs(engine, None)
        spec, spec_texts = _outputs(engine, config)
    finally:
        engine.speculation = saved
    assert len(plain) + len(plain_texts) >= 20
    assert sum(d.ok for d in plain) >= len(plain) - 2
    assert [d.text for d in spec] == [d.text for d in plain]
    assert [d.status for d in spec] == [d.status for d in plain]
    assert spec_texts == plain_texts
    return plain, spec


def test_greedy_speculative_equals_plain_on_real_prompts(engine):
    """20 real prompts (robot calls, BFCL held-out calls, free text) with an untrained draft and
    prompt lookup at a fixed k: many rejections, and still the plain greedy output."""
    plain, spec = _assert_same(engine, rejecting_config(engine))
    assert sum(d.draft_tokens for d in spec) > sum(d.accepted_tokens for d in spec) > 0  # both paths ran
    assert sum(d.forwards for d in spec) < sum(d.forwards for d in plain)


@pytest.mark.slow
def test_greedy_equal_with_shipped_draft(engine):
    """The same prompts with the default speculation (shipped draft, adaptive length)."""
    if engine.speculation is None or engine.speculation.draft is None:
        pytest.skip("no shipped draft for this target")
    _assert_same(engine, engine.speculation)


def test_shipped_draft_shares_the_targets_embedding_and_rotary_tables(engine):
    if engine.speculation is None or engine.speculation.draft is None:
        pytest.skip("no shipped draft for this target")
    net, target = engine.speculation.draft.net, engine.model
    assert net.tok_embeddings is target.tok_embeddings
    assert net.rope_cos is target.rope_cos and net.rope_sin is target.rope_sin
    cos, sin = rope_tables(net.args, length=net.rope_cos.shape[0])  # what the draft would compute itself
    assert torch.equal(cos, net.rope_cos) and torch.equal(sin, net.rope_sin)


def test_shipped_draft_holds_the_files_weights(engine):
    # the constructor leaves the draft's own weights uninitialized: `load` must set every one
    from safetensors.torch import load_file

    from tokenspeed.speculation import DEFAULT_DRAFT

    first, second = DraftModel.load(DEFAULT_DRAFT, engine.model), DraftModel.load(DEFAULT_DRAFT, engine.model)
    state, again = first.net.state_dict(), second.net.state_dict()
    assert all(torch.equal(t, again[k]) for k, t in state.items())  # nothing left from memory it was given
    saved = load_file(str(DEFAULT_DRAFT))
    norms = [k for k in saved if k.endswith("norm")]
    assert norms and all(torch.equal(state[k], saved[k].to(state[k].dtype)) for k in norms)
    assert torch.equal(first.net.output.weight, engine.model.output.weight[first.vocab])  # fp32 target: its head's rows


def test_kv_consistent_after_rejections_and_rollback(engine):
    saved = engine.speculation
    try:
        engine.speculation = None
        plain = engine.session(system=SYSTEM, tools=ROBOT_TOOLS)
        engine.speculation = rejecting_config(engine)
        spec = engine.session(system=SYSTEM, tools=ROBOT_TOOLS)
    finally:
        engine.speculation = saved
    for s in (plain, spec):
        s.observe(ROBOT_PROMPTS[1])
    cp = spec.checkpoint()
    d_plain, d_spec = plain.decide(), spec.decide()
    assert d_spec.text == d_plain.text and d_spec.draft_tokens > d_spec.accepted_tokens
    for s in (plain, spec):
        s.observe("Done. Now place it at x=0.40 y=0.12.")  # prefills the answer's tail after the KV
    assert spec.tokens == plain.tokens and spec.cache.n == plain.cache.n == len(plain.tokens)
    n = plain.cache.n
    # Not bit for bit: the dense fp32 GEMM's sums depend on its row count (verification rows vs one
    # decode row), ~1e-6 apart; in the fp16 CPU cache a key or value that close to a rounding boundary
    # lands one half-float ulp (<= 2^-10 relative) away, and the layers after it read that: measured,
    # 0.1% of the entries one ulp apart, 43 of 3.6M more than two, at most 0.006 (fp32 cache: 1e-4).
    for a, b in ((spec.cache.k, plain.cache.k), (spec.cache.v, plain.cache.v)):
        torch.testing.assert_close(a[:, :, :, :n].float(), b[:, :, :, :n].float(), rtol=2 ** -9, atol=1e-2)
    assert torch.equal(spec.cache.pos[:n], plain.cache.pos[:n])
    # Roll back over the speculative turn and decide again: same call, same cache length.
    spec.rollback(cp)
    again = spec.decide()
    assert again.text == d_spec.text
    assert spec.cache.n == len(spec.tokens)


def test_prompt_lookup_proposes_continuation_of_latest_match():
    lookup = PromptLookup(max_ngram=3, min_ngram=1)
    ctx = np.array([5, 6, 7, 8, 1, 5, 6, 7, 9, 2, 5, 6, 7])
    assert lookup.propose(ctx) == 9          # latest earlier "5 6 7" was followed by 9
    assert lookup.propose(np.array([1, 2, 3])) is None
    with pytest.raises(ValueError):
        PromptLookup(max_ngram=1, min_ngram=2)
    # only the last `horizon` tokens are searched: a proposal costs the same in an endless session
    far = np.concatenate([[5, 6, 7, 4], np.zeros(100, dtype=np.int64) + 3, [5, 6, 7]])
    assert PromptLookup(horizon=200).propose(far) == 4 and PromptLookup(horizon=50).propose(far) is None


def test_prompt_lookup_copies_values_of_the_last_message_in_order():
    """A call copies "10" then "5" from its request: the n-gram " " occurs before both, and the
    lookup takes the request's occurrences oldest first, skipping the value already copied."""
    END = 99
    # [older message: " " 7] END [request: base " " 1 0 height " " 5] END | output: " " 1 0 , " "
    ctx = [3, 40, 7, END, 11, 40, 1, 0, 12, 40, 5, END]
    out_start = len(ctx)
    lookup = PromptLookup(max_ngram=3, min_ngram=1)
    source = copy_source(ctx, out_start, {END})
    assert source == (4, out_start)
    assert lookup.propose(np.array(ctx + [40]), source) == 1           # first value of the request
    assert lookup.propose(np.array(ctx + [40, 1, 0, 33, 40]), source) == 5  # " 1" copied: next " "
    assert lookup.propose(np.array(ctx + [40]), None) == 5               # plain: latest occurrence


def test_prompt_lookup_candidates_mark_copies_from_the_last_message():
    END = 99
    ctx = [3, 40, 7, END, 11, 40, 1, 0, 12, 40, 5, END]
    source = copy_source(ctx, len(ctx), {END})
    cands = list(PromptLookup(max_ngram=1).candidates(np.array(ctx + [40]), source))
    assert cands[:3] == [(1, True), (5, True), (7, False)]  # the request's values first, oldest first


def test_message_match_proposes_the_enumeration_value_the_request_names():
    texts = {0: "pick", 1: "place", 2: "p", 3: "move", 4: "green", 5: "blue", 6: "st"}
    allowed = torch.zeros(10, dtype=torch.bool)
    allowed[[0, 1, 2, 3, 6]] = True
    match = MessageMatch("<|im_start|>user\nPlace the cube you hold at x=0.55, then move on.", texts.__getitem__)
    assert match.propose(allowed) == 1  # "place": earliest at a word start ("im_start" is no word start)
    allowed[:] = False
    allowed[[4, 5]] = True
    assert MessageMatch("Pick up the green cube.", texts.__getitem__).propose(allowed) == 4
    assert MessageMatch("Stop.", texts.__getitem__, max_allowed=1).propose(allowed) is None  # too many allowed


def test_forced_text_proposes_its_canonical_first_token(engine):
    """Before a string value the grammar forces the bytes ': "' but llguidance forces tokens only
    up to ':' (the token boundary after it is open); ForcedText proposes ' "', the canonical token,
    and the speculator puts it first in the chain, labelled "canonical"."""
    tok = engine.tokenizer
    tool = {"type": "function", "function": {"name": "find_concert", "description": "Find a concert.", "parameters": {
        "type": "object", "properties": {"location": {"type": "string"}}, "required": ["location"]}}}
    matcher = engine.grammar([tool], "required").matcher()
    assert tok.decode(matcher.compute_ff_tokens()).endswith('{"location":')
    assert matcher.consume_tokens(matcher.compute_ff_tokens())
    assert matcher.compute_ff_tokens() == [] and matcher.compute_ff_bytes() == b' "'
    forced = ForcedText(tok.encode)
    assert forced.propose(matcher) == tok.encode(' "')[0]
    spec = Speculator(SpecConfig(prompt_lookup=False, adaptive=False, max_k=1), 256)
    chain, sources, _, _ = spec.chain([], 1, matcher, None, True, 16, 0.0, forced_text=forced)
    assert chain[0] == forced.propose(matcher) and sources[0] == "canonical"
    matcher.consume_token(chain[0])
    assert forced.propose(matcher) is None  # inside the free string value: nothing forced


def test_unsure_draft_ends_the_chain(engine):
    """min_confidence: an untrained draft (flat distribution) proposes nothing, so speculation
    adds no rows; with gate 0 it proposes k tokens."""
    vocab = torch.arange(0, 8192)
    draft = DraftModel.init_from_target(engine.model, vocab, n_layers=1, hidden_dim=256)
    context = engine.tokenizer.encode("Count from 1 to 5: 1, 2, 3,")
    chains = []
    for gate in (0.0, 1.0):
        spec = Speculator(SpecConfig(prompt_lookup=False, draft=draft, max_k=4, adaptive=False,
                                     min_confidence=gate), 256)
        chains.append(spec.chain(context, 4, None, None, True, 16, 0.0)[0])
    assert len(chains[0]) == 4 and chains[1] == []


def test_windowed_draft_attends_over_the_recent_tokens_only(engine):
    """A pruned session's draft (window = KV budget) keeps at most 1.5 windows of KV however long
    the stream, sliding (old keys and values dropped, none recomputed); for a one-layer draft its
    logits equal a fresh draft's on the window it holds, and a rollback below the window's start
    refills it."""
    draft = DraftModel.init_from_target(engine.model, torch.arange(0, 8192), n_layers=1, hidden_dim=256)
    torch.manual_seed(0)
    stream = torch.randint(0, 8192, (300,)).numpy()
    state = draft.new_state(1024, window=64)
    for n in range(40, 301, 20):  # the context grows, as observations arrive
        out = state.logits(stream[:n])
        assert out is not None and state.cache.n <= 97 and n - state.offset <= 96
    assert state.anchor == 0 < state.offset  # slid, never refilled
    fresh = draft.new_state(1024).logits(stream[state.offset:300])
    # (its fp16 KV: keys rotated at other positions round otherwise, ~1e-3 relative on the logits)
    torch.testing.assert_close(out, fresh, rtol=1e-2, atol=2e-3)
    state.logits(stream[:50])  # rolled back before the window
    assert state.offset == state.anchor == 0 and state.cache.n == 50


def test_windowed_draft_refills_before_its_positions_pass_the_rotary_table(engine):
    """An endless pruned stream: the draft's rotary positions (context index - anchor) never
    pass its rotary table; it refills from position 0 instead (the market bridge's session raised
    IndexError after ~8200 tokens when the growth between two slides crossed the table's end)."""
    draft = DraftModel.init_from_target(engine.model, torch.arange(0, 8192), n_layers=1, hidden_dim=256)
    table = len(draft.net.rope_cos)
    torch.manual_seed(0)
    stream = torch.randint(0, 8192, (table + 300,)).numpy()
    state = draft.new_state(1024, window=64)
    for n in range(40, len(stream) + 1, 20):
        assert state.logits(stream[:n]) is not None
        assert n - state.anchor <= table
    assert state.anchor > 0


def test_adaptive_length_pays_for_likely_cheap_proposals_only():
    """Costs fitted from recorded forwards (1 token 100 ms, T tokens 150 + 10 T ms): a proposal
    that is surely accepted pays even with a long forced run (its rows are needed anyway), an
    even bet does not; calibration follows the verified outcomes of the draft model's proposals."""
    good, bad = AdaptiveLength(), AdaptiveLength()
    for T in (1, 2, 4, 8, 16) * 4:
        for length in (good, bad):
            length.record(T, 0.100 if T == 1 else 0.150 + 0.010 * T, [], 0.0)
    assert abs(good.forward_s(1) - 0.100) < 1e-3 and abs(good.forward_s(10) - 0.250) < 1e-3
    for _ in range(30):
        good.record(3, 0.18, [("model", 0.5, True)], 0.001)
        bad.record(3, 0.18, [("model", 0.9, False)], 0.001)
    assert good.estimate("model", 0.5) > 0.9 and bad.estimate("model", 0.9) < 0.1
    assert good.pays(1.0, 2, 3) and good.pays(1.0, 2, 14)  # saves a 90 ms forward overhead
    assert good.pays(0.7, 2, 3) and not good.pays(0.5, 2, 14)  # 63 > 3 ms; 45 < 60 ms for 12 rows
    assert not good.pays(0.5, 1, 2)  # 1 -> 2 tokens: 30 ms overhead saved half the time < +70 ms half the time
    assert not bad.pays(bad.estimate("model", 0.9), 2, 3)
    probes = [bad.probe() for _ in range(2 * bad.probe_every)]
    assert sum(probes) == 2 and probes[bad.probe_every - 1]  # off, with a periodic probe


def test_draft_model_is_switched_off_while_its_calls_cost_more_than_they_save():
    """Same costs (a 1-token forward 100 ms, each extra row 10 ms): a draft model whose calls
    take 80 ms and propose once in four calls (saving ~90 ms) loses time, so it is called only
    every probe_every-th time; accepted proposals from cheap calls bring it back."""
    length = AdaptiveLength()
    for T in (1, 2, 4, 8, 16) * 4:
        length.record(T, 0.100 if T == 1 else 0.150 + 0.010 * T, [], 0.0)
    assert length.model_on()
    for _ in range(10):
        length.record(4, 0.19, [("model", 0.9, True)], 0.32, model_calls=4, model_s=0.32)
    calls = [length.model_on() for _ in range(2 * length.probe_every)]
    assert sum(calls) == 2 and calls[length.probe_every - 1]
    for _ in range(10):
        length.record(4, 0.19, [("model", 0.9, True)], 0.002, model_calls=1, model_s=0.002)
    assert length.model_on()
    for expected in (True, True, True, False):  # each rejection discards 6 rows (60 ms) against ~90 ms saved
        length.record(8, 0.23, [("model", 0.9, False)], 0.002, model_calls=1, model_s=0.002, discarded=6)
        assert length.model_on() == expected


# ------------------------------------------------------------------ sampling distribution

V, PROMPT, N_OUT = 5, [0, 1, 2, 0, 1], 3


def _tiny(seed):
    torch.manual_seed(seed)
    args = ModelArgs(dim=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16, hidden_dim=64,
                     vocab_size=V, max_seq_len=64, tie_embeddings=True)
    net = Transformer(args)
    with torch.no_grad():
        for p in net.parameters():
            p.normal_(0.0, 0.8 if p.dim() > 1 else 0.1).add_(1.0 if p.dim() == 1 else 0.0)
    return net.eval()


def _tiny_target(model):
    """The decode loop's target over a small-vocabulary model (no tokenizer or grammar needed)."""
    return Target(model, model.new_cache(64))


def _exact_distribution(model):
    """P(x1..xN | PROMPT) for all V^N outputs (temperature 1)."""
    probs = {}
    for seq in itertools.product(range(V), repeat=N_OUT):
        cache = model.new_cache(64)
        ids = torch.tensor(PROMPT + list(seq[:-1]))
        logits = model(ids, torch.arange(len(ids)), cache, "all")[len(PROMPT) - 1:]
        p = torch.softmax(logits, -1)
        probs[seq] = float(torch.prod(p[torch.arange(N_OUT), torch.tensor(seq)]))
    return probs


@pytest.fixture
def one_thread():
    """Tiny models are dominated by thread start-up on a busy machine: run them on one thread."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_rejection_sampling_preserves_target_distribution(one_thread):
    target = _tiny(1)
    draft = DraftModel(target, replace(target.args, n_layers=1), torch.arange(V))
    other = _tiny(2)  # a different model's layers: q != p
    with torch.no_grad():
        for mine, theirs in zip(draft.net.layers.parameters(), other.layers.parameters()):
            mine.copy_(theirs)
        draft.net.norm.copy_(other.norm)
    config = SpecConfig(draft=draft, max_k=N_OUT, adaptive=False, min_ngram=1)
    exact = _exact_distribution(target)
    gen = torch.Generator().manual_seed(0)
    n = 2000
    counts = dict.fromkeys(exact, 0)
    drafted = accepted = 0
    for _ in range(n):
        out, _, d = decode(_tiny_target(target), Speculator(config, 64), list(PROMPT), max_tokens=N_OUT,
                           temperature=1.0, generator=gen)
        counts[tuple(out)] += 1
        drafted, accepted = drafted + d.draft_tokens, accepted + d.accepted_tokens
    assert 0 < accepted < drafted  # rejections happened, so the residual distribution was used
    # Pearson chi-square over cells with expected count >= 5 (the rest pooled).
    big = [k for k in exact if exact[k] * n >= 5]
    obs = [counts[k] for k in big] + [n - sum(counts[k] for k in big)]
    exp = [exact[k] * n for k in big] + [n - sum(exact[k] * n for k in big)]
    chi2 = sum((o - e) ** 2 / e for o, e in zip(obs, exp) if e > 0)
    dof = len(obs) - 1
    # Wilson-Hilferty approximation of the chi-square 0.999 quantile.
    z = 3.09
    limit = dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3
    assert chi2 < limit, (chi2, limit, dof)


@pytest.fixture(scope="module")
def pipelined():
    """The embedded model, fp32, pipelined (on the CPU: host work on a worker thread)."""
    return tokenspeed.Engine.load(quantize=None, pipeline=True)


def test_pipelined_drafting_equals_plain_on_real_prompts(engine, pipelined):
    """Drafting the next chain during the forward (on the worker thread) changes no token: the 20
    real prompts give the plain greedy output, under the untrained draft at a fixed
    k (its guesses miss) and the default speculation (some come true)."""
    assert pipelined.host_worker is not None
    plain, plain_texts = _outputs(engine, None)
    saved, ahead = pipelined.speculation, 0
    try:
        for config in (rejecting_config(pipelined), saved):
            spec, spec_texts = _outputs(pipelined, config)
            assert [d.text for d in spec] == [d.text for d in plain]
            assert [d.status for d in spec] == [d.status for d in plain]
            assert spec_texts == plain_texts
            ahead += sum(d.drafted_ahead for d in spec)
    finally:
        pipelined.speculation = saved
    assert ahead > 0


def test_a_forward_failing_beside_the_host_work_fails_the_call_as_without_it(tiny_engine):
    """A forward that raises while the worker thread drafts ahead raises as it does without
    pipelining, and the session's cache and token ids stay consistent."""
    worker = tokenspeed.Engine.load("tiny-random", pipeline=True)
    fixed = SpecConfig(adaptive=False, max_k=4)  # prompt lookup at a fixed k: the same steps in both
    saved, errors = tiny_engine.speculation, []
    try:
        for e in (tiny_engine, worker):
            e.speculation = fixed
            s = e.session(capacity=48)
            with pytest.raises(ValueError, match="KV cache") as info:
                s.generate("Count from one to one hundred, slowly.", max_tokens=64)
            errors.append(str(info.value))
            assert s.cache.n == len(s.target.tokens)
    finally:
        tiny_engine.speculation = saved
    assert errors[0] == errors[1]


def test_host_work_beside_a_cpu_forward_runs_on_the_worker_with_the_callers_thread_count():
    """torch's intra-op thread count is per thread: the worker takes the caller's (the ROS nodes
    change `threads` live)."""
    target = tokenspeed.Engine.load("tiny-random", pipeline=True).session().target
    before = torch.get_num_threads()
    try:
        for n in (1, 2, 1):
            torch.set_num_threads(n)
            logits, threads, overlapped = target.forward_beside([1], "last", None, torch.get_num_threads)
            assert threads == n and overlapped and logits.shape == (1, target.model.args.vocab_size)
    finally:
        torch.set_num_threads(before)
