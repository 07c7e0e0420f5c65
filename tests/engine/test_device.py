"""Device-generic sessions: no tensor of a session, the decode loop, speculation or the grammar
masks is made without the model's device, checked on the CPU by making "meta" torch's default
device - a tensor created without an explicit device then lands on meta, where it cannot be read
or mixed with the model's tensors, and the decision fails. Host buffers say device="cpu". The
decode step as CUDA graphs: its bookkeeping, run eagerly on the CPU, and its fallback. No hidden
host reads in the decode loop: its forwards run with the model on meta, where reading a tensor raises."""
import logging

import pytest
import torch

import tokenspeed
from tokenspeed.device import DecodeGraphs
from tokenspeed.kv import KVConfig
from tokenspeed.speculation import SpecConfig

PROMPT = "The red cube is at x=0.42 y=-0.10. Move above it."


def _turn(engine, tools, **sampling):
    """A greedy decision and a reply (sampled with `sampling`) in a new session: (call text, reply)."""
    session = engine.session(system="You control a robot arm.", tools=tools)
    session.observe(PROMPT)
    text = session.decide(max_tokens=40).text
    return text, session.generate("Say what you did.", max_tokens=5, **sampling)


def _same_on_meta(engine, tools, **sampling):
    reference = _turn(engine, tools, **sampling)
    with torch.device("meta"):
        assert _turn(engine, tools, **sampling) == reference


def test_no_tensor_is_made_off_the_models_device(engine, tiny_engine, robot_tools, monkeypatch):
    # The Python forward (what CUDA runs; the fused C++ step is CPU-only) and proposals at every
    # step: the draft model alone on the real model (no copy drafters to pre-empt it), then the
    # copy drafters on the tiny one; greedy decisions, sampled replies.
    for e in (engine, tiny_engine):
        monkeypatch.setattr(e.model, "use_fused", False)
    monkeypatch.setattr(engine, "speculation", SpecConfig(draft=engine.speculation.draft, prompt_lookup=False,
                                                          forced_text=False, adaptive=False))
    assert engine.speculation.draft is not None
    _same_on_meta(engine, robot_tools, temperature=0.8, seed=1)
    monkeypatch.setattr(tiny_engine, "speculation", SpecConfig(adaptive=False))
    _same_on_meta(tiny_engine, robot_tools)
    _same_on_meta(tiny_engine, robot_tools, temperature=0.8, seed=1)


def _pruned_turns(engine, tools):
    """Twelve readings and decisions in a session pruned to a 640-token hot tier (evictions to the
    cold tier), then a rollback past the evictions and one more decision: (call texts, tokens)."""
    session = engine.session(system="You control a robot arm.", tools=tools, kv_budget=640)
    texts, early = [], None
    for i in range(12):
        if i == 3:
            early = session.checkpoint()
        session.observe(f"camera sees red_cube at x=0.4{i} y=-0.1{i}; joints q=[{i / 10:.2f},0.50]",
                        kind="sensor", source=f"sensor{i % 3}")
        texts.append(session.decide(max_tokens=24).text)
    assert session.cache.take_metrics()["totals"]["evicted"] > 0
    session.rollback(early)
    texts.append(session.decide(max_tokens=24).text)
    return texts, session.tokens


def test_a_pruned_session_makes_no_tensor_off_its_device(tiny_engine, robot_tools, monkeypatch):
    # The tiered KV cache's hot tier on the model's device, its cold tier's host tensors on "cpu"
    # (pinned on CUDA): eviction, cold-tier bookkeeping and rollback give the same outputs on meta.
    monkeypatch.setattr(tiny_engine.model, "use_fused", False)
    monkeypatch.setattr(tiny_engine, "speculation", SpecConfig(adaptive=False))
    reference = _pruned_turns(tiny_engine, robot_tools)
    with torch.device("meta"):
        assert _pruned_turns(tiny_engine, robot_tools) == reference


def test_bfloat16_session_keeps_its_dtype(robot_tools):
    engine = tokenspeed.Engine.load("tiny-random", dtype="bfloat16")
    assert engine.weights == "bf16" and engine.device == torch.device("cpu")
    session = engine.session(tools=robot_tools)
    assert session.cache.k.dtype == torch.bfloat16
    session.observe("The red cube is at x=0.42 y=-0.10. Pick it up.")
    d = session.decide(max_tokens=64)
    assert d.status in ("ok", "invalid") and d.forwards > 0, d.reason  # random weights: any call, no dtype error
    assert "grammar rejected" not in d.reason and "non-finite" not in d.reason


def _graph_turn(engine, tools, capture=None):
    """A decision in a new session (1024-token cache) whose decode and verification forwards run
    through `DecodeGraphs` (capture=None: no runner, the model's own forward): (text, session)."""
    session = engine.session(system="You control a robot arm.", tools=tools, capacity=1024)
    if capture is not None:
        session.target.graphs = DecodeGraphs(engine.model, session.cache, max_width=16, capture=capture)
    session.observe(PROMPT)
    return session.decide(max_tokens=48).text, session


def test_decode_graph_bookkeeping_on_the_cpu(tiny_engine, robot_tools, monkeypatch, caplog):
    # The CPU runs the graphs' static step eagerly through the same buffers: same greedy call as the
    # plain path, one buffer set per forward width used, the cache advanced as by the plain path.
    monkeypatch.setattr(tiny_engine, "speculation", SpecConfig(adaptive=False))  # verification widths > 1
    text, plain = _graph_turn(tiny_engine, robot_tools)
    got, session = _graph_turn(tiny_engine, robot_tools, capture=False)
    graphs = session.target.graphs
    assert got == text and session.tokens == plain.tokens and session.cache.n == plain.cache.n
    assert max(graphs.widths, default=0) > 1, sorted(graphs.widths)  # decode steps and verifications
    assert all(b.inputs.shape == (3, w) and not b.graphs for w, b in graphs.widths.items())
    assert torch.equal(session.cache.pos[:session.cache.n], plain.cache.pos[:plain.cache.n])
    # A capture that fails (here for real: this torch has no CUDA; on a GPU, a fake raises) leaves
    # the runner eager after one log line, with the same output.
    if torch.cuda.is_available():
        monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: (_ for _ in ()).throw(RuntimeError("fake capture fault")))
    with caplog.at_level(logging.WARNING, logger="tokenspeed.device"):
        got, session = _graph_turn(tiny_engine, robot_tools, capture=True)
    assert got == text and session.target.graphs.eager
    assert len(caplog.records) == 1, caplog.text
    assert caplog.records[0].getMessage().startswith("CUDA graph capture of a "), caplog.text


def _next_position_truth(session):
    """The next position as the device holds it: the newest position + 1 (the cached tokens' count
    when a rollback lost the newest tokens)."""
    c = session.cache
    newest = int(c.pos[:c.n].max()) + 1 if c.n else 0
    assert newest <= len(session.tokens)
    return len(session.tokens)


def test_the_host_next_position_follows_the_cache(tiny_engine, robot_tools, monkeypatch):
    # The cache keeps the next rotary position on the host (no forward reads it back from the
    # device): decisions with speculation (rejected draft tokens truncated), observations, trims
    # and evictions to the cold tier, recalls and rollbacks keep it equal to what the device holds.
    monkeypatch.setattr(tiny_engine, "speculation", SpecConfig(adaptive=False))
    plain = tiny_engine.session(system="You control a robot arm.", tools=robot_tools)
    pruned = tiny_engine.session(system="You control a robot arm.", tools=robot_tools,
                                 kv_budget=KVConfig(budget=640, recall_threshold=1e-6))  # recalls often
    for session in (plain, pruned):
        early = None
        for i in range(12):
            if i == 3:
                early = session.checkpoint()
            session.observe(f"camera sees red_cube at x=0.4{i} y=-0.1{i}; joints q=[{i / 10:.2f},0.50]")
            assert session.cache.next_position() == _next_position_truth(session)
            session.decide(max_tokens=24)
            assert session.cache.next_position() == _next_position_truth(session)
        late = session.checkpoint()
        session.observe("The gripper slipped.")
        session.rollback(late)
        assert session.cache.next_position() == _next_position_truth(session)
        session.rollback(early)
        assert session.cache.next_position() == _next_position_truth(session)
        session.decide(max_tokens=24)
        assert session.cache.next_position() == _next_position_truth(session)
    assert plain.cache.next_position() == int(plain.cache.pos[plain.cache.n - 1]) + 1
    totals = pruned.cache.take_metrics()["totals"]
    assert totals["evicted"] > 0 and totals["recalled"] > 0, totals
    # a sliding window (the draft model's cache) drops the oldest slots: the next position stays
    cache = tiny_engine.model.new_cache(64)
    tiny_engine.model(torch.arange(40), 100, cache, "none")
    cache.drop_oldest(30)
    assert cache.n == 10 and cache.next_position() == 140 == int(cache.pos[9]) + 1
    cache.truncate(4)
    assert cache.next_position() == 134 == int(cache.pos[3]) + 1


def test_decode_forwards_read_nothing_back_from_the_device(tiny_engine):
    # The decode loop reads the device once per forward, in `_choices` (the chosen token ids).
    # Everything before that read - decode steps, verification forwards with selected rows and
    # lm_head rows, rejected tokens dropped, over the plain cache, the pruned cache inside a
    # decision and the decode graphs' step; then grammar masks and greedy or sampled choices - runs
    # here on the "meta" device, where any host read of a tensor (int(), .item(), .tolist(),
    # bool(), .cpu()) raises.
    from tokenspeed.decode import Target, _choose_rows
    from tokenspeed.grammar import TokenMask
    from tokenspeed.kv import TieredKVCache
    from tokenspeed.model import Transformer

    args = tiny_engine.args
    with torch.device("meta"):
        model = Transformer(args)
    model.use_fused = False  # the C++ step is CPU-only
    V = args.vocab_size
    caches = [lambda: model.new_cache(256),
              lambda: TieredKVCache(args, KVConfig(budget=256, cold=256), device="meta")]
    for make_cache, graphs in ((caches[0], False), (caches[0], True), (caches[1], False)):
        cache = make_cache()
        target = Target(model, cache, graphs=DecodeGraphs(model, cache, capture=False) if graphs else None)
        with cache.decision():
            assert target.forward(list(range(40)), "none") is None          # the decision's prefill
            assert target.forward([5], "last").shape == (1, V)              # a decode step
            rows = torch.tensor([0, 2, 3]).to("meta")
            assert target.forward([6, 7, 8, 9], rows).shape == (3, V)       # a verification
            target.discard(2)                                               # two drafts rejected
            logits = target.forward([10], "last", head_rows=torch.tensor([1, 5, 9]))  # grammar's rows
        assert logits.shape == (1, V) and logits.device.type == "meta"
        assert cache.n == cache.next_position() == len(target.tokens) == 44
    mask, select = TokenMask(V, device="meta"), torch.arange(3).to("meta")
    words = torch.full((3, mask.n_words), -1, dtype=torch.int32)  # every id allowed
    q = torch.full((V,), 1.0 / V).to("meta")  # a sampled draft's distribution
    for temperature in (0.0, 0.8):  # greedy; rejection sampling of a deterministic and a sampled proposal
        chosen, finite = _choose_rows(torch.zeros(3, V).to("meta"), words, select, mask,
                                      [(6, None), (7, q), (None, None)], temperature, 0.9, None)
        assert chosen.shape == (3,) and chosen.device.type == finite.device.type == "meta"
    # the check is live: a forward given its positions as a device tensor reads their maximum
    with pytest.raises((RuntimeError, NotImplementedError)):
        model(torch.tensor([11]).to("meta"), torch.tensor([43]).to("meta"), model.new_cache(64))


def test_pipelining_is_on_by_default_on_cuda_only_and_a_pipelined_cpu_engine_has_a_host_worker():
    from tokenspeed.device import host_worker, resolve_pipeline

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_pipeline(cuda) and not resolve_pipeline(cpu)
    assert resolve_pipeline(cpu, True) and not resolve_pipeline(cuda, False)
    assert host_worker(cpu, True) is not None
    assert host_worker(cpu, False) is None and host_worker(cuda, True) is None  # CUDA: queued kernels
