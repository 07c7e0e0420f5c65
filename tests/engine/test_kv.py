"""Relevance-pruned, tiered KV cache: eviction order, pins, positions, recall, rollback.

Uses the 2-layer random-weight model (real tokenizer): the properties tested here are exact
bookkeeping facts, not model quality (the needle benchmark in `tokenspeed.bench.kv` measures
that with the real model; a short version is the slow test at the end).
"""
import json
from pathlib import Path

import pytest
import torch

from tokenspeed.kv import KVConfig
from tokenspeed.model import rope_tables

TOOLS = json.loads((Path(__file__).resolve().parents[2] / "engine/data/tools/robot_tools.json").read_text())


def _session(tiny_engine, **kw):
    kw.setdefault("recent", 64)  # small budgets: the default (half the budget) would leave no room to evict
    return tiny_engine.session(system="You control a robot arm.", tools=TOOLS[:1], kv_budget=KVConfig(**kw))


def _fill(s, n_obs, kind="text", source=""):
    # n_obs observations of ~40 tokens each
    for i in range(n_obs):
        s.observe(f"reading {i}: value {i * 7 % 13} at station {i % 5}, " * 2, kind=kind, source=source)


def test_config_rejects_bad_budgets(tiny_engine):
    with pytest.raises(ValueError, match="budget"):
        KVConfig(budget=50)
    with pytest.raises(ValueError):
        KVConfig(budget=1024, decay=1.5)
    with pytest.raises(ValueError):
        tiny_engine.session(kv_budget=10)
    for bad in (0, -5, True, 256.0, "256", float("nan")):
        with pytest.raises(ValueError, match="positive int|int \\(tokens\\)"):
            tiny_engine.session(kv_budget=bad)
    with pytest.raises(ValueError, match="pinned system prompt"):  # the tool schemas alone exceed it
        tiny_engine.session(system="You control a robot arm.", tools=TOOLS, kv_budget=160)
    s = tiny_engine.session(kv_budget=300)
    with pytest.raises(ValueError, match="kind"):
        s.observe("lidar scan", kind="lidar")


def test_budget_holds_and_positions_stay_original(tiny_engine):
    s = _session(tiny_engine, budget=300, cold=256)
    _fill(s, 10)
    c = s.cache
    assert s.num_tokens > 450 and c.n <= 300
    pos = c.pos[:c.n]
    hot = set(pos.tolist())
    assert len(hot) == c.n                                      # one slot per position
    assert c.next_position() == s.num_tokens                    # the newest token is hot
    assert {0, 1, 2, 3} <= hot                                  # sinks
    assert set(range(s.num_tokens - 64, s.num_tokens)) <= hot   # recent window
    # Layer-0 keys depend only on token and position: every hot slot equals the full cache's.
    full = tiny_engine.session(system="You control a robot arm.", tools=TOOLS[:1])
    _fill(full, 10)
    assert full.tokens == s.tokens
    torch.testing.assert_close(c.k[0, :, :, :c.n], full.cache.k[0, :, :, pos], rtol=0, atol=0)
    m = c.take_metrics()
    assert m["hot"] == c.n and m["evicted"] == s.num_tokens - c.n and m["cold"] <= 256


def test_system_prompt_and_caller_pins_survive(tiny_engine):
    s = _session(tiny_engine, budget=340, cold=0)
    n_sys = s.num_tokens
    _fill(s, 2)
    s.observe("Remember: part_07 must be grasped with force 3.", pin=True)
    pinned = next(seg for seg in s.segments if seg.pinned and seg.kind == "text")
    _fill(s, 9)
    hot = set(s.cache.pos[:s.cache.n].tolist())
    assert set(range(n_sys)) <= hot
    assert set(range(pinned.start, pinned.end)) <= hot


def test_a_new_pin_of_a_source_supersedes_the_last(tiny_engine):
    """Goals arrive pinned, one per task, for as long as the robot runs: the newest goal stays
    pinned, older goals of the same source lose their pin and leave first, so pins never fill the
    cache (the 60-min soak's agent raised "KV cache full" after ~20 tasks)."""
    s = _session(tiny_engine, budget=340, cold=0)
    n_sys = s.num_tokens
    for task in range(40):
        s.observe(f"goal: put cube {task} on target {task % 3} at x=0.{task} y=0.1, then report done", pin=True,
                  source="goal")
        _fill(s, 1, kind="sensor", source="state")
    goals = [seg for seg in s.segments if seg.source == "goal"]
    hot = set(s.cache.pos[:s.cache.n].tolist())
    assert s.cache.n <= 340 and set(range(n_sys)) <= hot
    assert set(range(goals[-1].start, goals[-1].end)) <= hot
    assert sum(bool(set(range(g.start, g.end)) & hot) for g in goals) <= 5   # of 40: the newest, and what room allows


def test_superseded_sensor_readings_leave_first(tiny_engine):
    s = _session(tiny_engine, budget=400, cold=0)
    _fill(s, 2)
    _fill(s, 8, kind="sensor", source="joint_states")
    c = s.cache
    c.score[:c.n] = 1.0          # equal relevance: only supersession can explain the order
    c.score[:c.n][c.pos[:c.n] >= s.segments[-1].start] = 0.0    # ...even against a low score
    before = set(c.pos[:c.n].tolist())
    c.evict_to(c.n - 48)
    gone = before - set(c.pos[:c.n].tolist())
    old = [seg for seg in s.segments if seg.kind == "sensor"][:-1]
    assert len(gone) >= 48
    assert all(any(seg.start <= p < seg.end for seg in old) for p in gone)


def test_lowest_relevance_page_goes_first(tiny_engine):
    s = _session(tiny_engine, budget=400, cold=512)
    _fill(s, 8)
    c = s.cache
    pos = c.pos[:c.n]
    c.score[:c.n] = 1.0
    low_page = int(pos[pos >= 200][0]) // 16
    c.score[:c.n][pos // 16 == low_page] = 0.01
    c.evict_to(c.n - 1)
    assert not bool((c.pos[:c.n] // 16 == low_page).any())
    assert low_page in c.cold.slot_of


def test_recalled_kv_equals_original(tiny_engine):
    s = _session(tiny_engine, budget=400, cold=512, recall_threshold=0.01)
    _fill(s, 8)
    c = s.cache
    sel = ((c.pos[:c.n] // 16) == 14).nonzero().squeeze(1)
    sel = sel[torch.argsort(c.pos[sel])]
    want_pos, want_k, want_v = c.pos[sel].clone(), c.k[:, :, :, sel].clone(), c.v[:, :, :, sel].clone()
    c.score[:c.n] = 1.0
    c.score[sel] = 0.0
    c.evict_to(c.n - 1)
    assert 14 in c.cold.slot_of and not bool(((c.pos[:c.n] // 16) == 14).any())
    # A query aligned with one of the page's keys, in every layer and head, asks for it back.
    L, H = c.args.n_layers, c.args.n_heads
    key = want_k[:, 0, :, 3].float()                              # [L, Hkv, D] (queries are fp32)
    q = key.repeat_interleave(H // c.args.n_kv_heads, dim=1).unsqueeze(2) * 50.0
    c._q, c._lse = list(q), list(torch.zeros(L, H, 1))
    c._prefetch()
    c.prepare(1)
    assert c.totals["recalled"] >= want_pos.numel() and c.totals["prefetch_hits"] >= 1
    slots = torch.isin(c.pos[:c.n], want_pos).nonzero().squeeze(1)
    slots = slots[torch.argsort(c.pos[slots])]                   # slot order is free: compare by position
    assert torch.equal(c.pos[slots], want_pos)
    assert torch.equal(c.k[:, :, :, slots], want_k)
    assert torch.equal(c.v[:, :, :, slots], want_v)
    assert len(set(c.pos[:c.n].tolist())) == c.n
    assert 14 not in c.cold.slot_of


def test_rollback_across_evictions_restores_hot_tier_exactly(tiny_engine):
    s = _session(tiny_engine, budget=300, cold=2048)
    _fill(s, 9)
    c = s.cache
    cp = s.checkpoint()
    before = (c.pos[:c.n].clone(), c.k[:, :, :, :c.n].clone(), c.score[:c.n].clone(), list(s.tokens))
    logits_before = s._forward([42]).clone()
    s.rollback(cp)
    _fill(s, 10)                                                  # many evictions after cp
    assert c.totals["evicted"] > 0 and not torch.equal(c.pos[:c.n], before[0][:c.n])
    s.rollback(cp)
    assert torch.equal(c.pos[:c.n], before[0])
    assert torch.equal(c.k[:, :, :, :c.n], before[1])
    assert torch.equal(c.score[:c.n], before[2])
    assert s.tokens == before[3] and c.totals["rollback_lost"] == 0
    torch.testing.assert_close(s._forward([42]), logits_before, rtol=0, atol=0)


@pytest.mark.parametrize("keep", [10, 10_000])
def test_restore_that_keeps_tokens_after_the_snapshot(tiny_engine, keep):
    """`restore(n, snapshot, keep)` (a session's observe(since=...)): the snapshot's hot tier in its
    slot order and scores, then the kept run of positions n.. (as many as asked and hot), in position
    order, with their keys and values and score 0; nothing later stays, hot or cold."""
    s = _session(tiny_engine, budget=300, cold=2048)
    _fill(s, 9)
    c = s.cache
    cp = s.checkpoint()
    evicted = c.totals["evicted"]
    _fill(s, 1)                                                   # ~40 tokens after cp, all recent (hot)
    assert c.totals["evicted"] > evicted                          # older pages left for the cold tier
    n, after = cp.n_tokens, s.num_tokens
    slot = {int(p): i for i, p in enumerate(c.pos[:c.n].tolist())}
    want = torch.arange(n, min(n + keep, after))
    k, v = c.k[:, :, :, [slot[int(p)] for p in want]].clone(), c.v[:, :, :, [slot[int(p)] for p in want]].clone()
    kept = c.restore(n, cp.kv, keep)
    m = cp.kv.pos.numel()
    assert kept == want.numel() and c.n == m + kept and c.next_position() == n + kept
    assert torch.equal(c.pos[:m], cp.kv.pos) and torch.equal(c.score[:m], cp.kv.score)
    assert torch.equal(c.pos[m:c.n], want) and bool((c.score[m:c.n] == 0).all())
    assert torch.equal(c.k[:, :, :, m:c.n], k) and torch.equal(c.v[:, :, :, m:c.n], v)
    assert all(int(c.cold.pos[slot_, :int(c.cold.count[slot_])].max()) < n + kept for slot_ in c.cold.slot_of.values())


def test_rollback_without_cold_tier_reports_lost_tokens(tiny_engine):
    s = _session(tiny_engine, budget=300, cold=0)
    _fill(s, 9)
    cp = s.checkpoint()
    _fill(s, 10)
    s.rollback(cp)
    assert s.cache.totals["rollback_lost"] > 0
    assert s.cache.next_position() == s.num_tokens


def test_decide_reports_metrics_and_history_outgrows_max_seq_len(tiny_engine):
    s = _session(tiny_engine, budget=300, cold=256)
    long = " ".join(f"w{i}" for i in range(1500))                # ~3000 tokens per observe
    while s.num_tokens <= tiny_engine.args.max_seq_len:               # 4096 for tiny-random
        s.observe(long, kind="sensor", source="lidar")
    assert s.cache.n <= 300 and int(s.cache.pos[s.cache.n - 1]) >= tiny_engine.args.max_seq_len
    d = s.decide(deadline=30, max_tokens=8)
    assert d.kv is not None and d.kv["budget"] == 300 and d.kv["hot"] >= 300 - 64
    assert set(d.kv) >= {"hot", "cold", "evicted", "recalled", "prefetch_hits", "prefetch_misses"}
    # the rotary tables do not grow with the history (a long-running session's memory stays flat):
    # later positions' rotations are computed, equal to the rows of a table that long
    model = tiny_engine.model
    assert model.rope_cos.shape[0] == model.rope_sin.shape[0] == tiny_engine.args.max_seq_len
    pos = torch.tensor([0, tiny_engine.args.max_seq_len - 1, s.num_tokens, 3 * s.num_tokens])
    cos, sin = model.rope_at(pos, 3 * s.num_tokens + 1)
    table_cos, table_sin = rope_tables(tiny_engine.args, length=3 * s.num_tokens + 1)
    assert torch.equal(cos, table_cos[pos]) and torch.equal(sin, table_sin[pos])


@pytest.mark.slow
def test_needle_survives_a_sensor_stream_with_the_real_model(engine):
    from tokenspeed.bench import kv as kv_bench

    configs = {"full": None, "pruned+cold": KVConfig(budget=512, cold=4096)}
    rows = kv_bench.needle(engine, configs, streams=(600, 600), facts=1, log=lambda *a: None)
    full = [r["correct"] for r in rows if r["config"] == "full"]
    pruned = [r["correct"] for r in rows if r["config"] == "pruned+cold"]
    assert pruned == full


def test_a_decision_runs_over_the_hot_set_its_question_recalled(tiny_engine):
    # recall_threshold tiny: every cold page qualifies, so any forward allowed to prefetch stages pages.
    s = _session(tiny_engine, budget=300, cold=2048, recall_threshold=1e-6)
    _fill(s, 9)
    c = s.cache
    assert c._staged                           # staged by the last observation's forward
    with c.decision():
        s._forward([42, 43])                   # recalled before the decision's first forward...
        recalled = c.totals["recalled"]
        assert recalled > 0 and not c._staged  # ...which prefetches nothing
        for t in (44, 45, 46):
            s._forward([t])
        assert c.totals["recalled"] == recalled and not c._staged
    s._forward([47])
    assert c._staged                           # outside a decision every forward prefetches


def test_recall_brings_an_observation_back_whole_or_not_at_all(tiny_engine):
    s = _session(tiny_engine, budget=400, cold=2048, recall_threshold=0.01)
    _fill(s, 8)
    c = s.cache
    seg = s.segments[3]                                           # one ~40-token observation
    pages = set(range(seg.start // 16, (seg.end - 1) // 16 + 1))
    sel = torch.isin(c.pos[:c.n] // 16, torch.tensor(sorted(pages))).nonzero().squeeze(1)
    key = c.k[:, 0, :, sel[0]].clone()                            # [L, Hkv, D]
    c.score[:c.n] = 1.0
    c.score[sel] = 0.0
    c.evict_to(c.n - sel.numel())
    assert pages <= set(c.cold.slot_of)
    size = int(sum(int(c.cold.count[c.cold.slot_of[p]]) for p in pages))
    L, H = c.args.n_layers, c.args.n_heads
    q = key.float().repeat_interleave(H // c.args.n_kv_heads, dim=1).unsqueeze(2) * 50.0  # fp32 queries

    def recall(room):
        c.config.recall_room = c.n - c.config.budget + room       # exactly `room` tokens free
        c._q, c._lse = list(q), list(torch.zeros(L, H, 1))
        c._prefetch()
        c.prepare(1)
        return set((c.pos[:c.n] // 16).tolist()) & pages

    assert recall(size - 1) == set()                              # does not fit whole: stays cold
    assert recall(size) == pages                                  # fits: every page comes back


def test_prefetch_copies_are_issued_after_a_forward_and_waited_for_before_they_are_read(tiny_engine):
    """`PageTransfer` bookkeeping (on CUDA a side stream and an event; here the same state with
    synchronous copies): issued after an observation's forward and left in flight through its
    eviction (new pages go to free slots), waited for once by the next forward, which reads the
    copies; the recalled pages' siblings copied the same way and waited for before insertion;
    never issued inside a decision otherwise."""
    s = _session(tiny_engine, budget=300, cold=2048, recall_threshold=1e-6)
    _fill(s, 9)
    c, tr = s.cache, s.cache.cold.transfer
    assert c._staged and tr.in_flight and tr.issued >= 1       # staged by the last observation's forward
    assert c.totals["evicted"] > 0
    assert all(k.device == c.k.device for _, k, _, _ in c._staged)
    issued, waited = tr.issued, tr.waited
    with c.decision():
        s._forward([42])                                        # recall: waits, then reads the copies;
        assert tr.issued == issued + 1 and tr.waited == waited + 2  # the hits' siblings: one batch, waited for
        assert not tr.in_flight and c.totals["recalled"] > 0
        for t in (43, 44):
            s._forward([t])
        assert tr.issued == issued + 1 and tr.waited == waited + 2  # nothing issued, nothing to wait for
    s._forward([45])
    assert tr.in_flight and tr.issued == issued + 2


def test_cold_tier_waits_for_copies_in_flight_only_before_rewriting_a_slot_they_read(tiny_engine):
    """A slot freed while a prefetch is in flight is fenced: put() waits before reusing it; a put
    into a slot no copy reads does not wait. Pages come back bit-identical."""
    from tokenspeed.cold_tier import ColdTier

    args = tiny_engine.args
    cold = ColdTier(args, tokens=64, page=16, dtype=torch.float32, device="cpu")
    g = torch.Generator().manual_seed(0)

    def page(pid):
        shape = (args.n_layers, args.n_kv_heads, 16, args.head_dim)
        return torch.randn(shape, generator=g), torch.randn(shape, generator=g), torch.arange(16) + 16 * pid

    a, b = page(0), page(1)
    cold.put(0, *a, 0.5, False)
    cold.put(1, *b, 0.5, False)
    (pid, k, v, pos), = cold.prefetch([0])
    assert pid == 0 and torch.equal(k, a[0]) and torch.equal(v, a[1]) and torch.equal(pos, a[2])
    tr = cold.transfer
    assert tr.in_flight and tr.waited == 0
    cold.put(2, *page(2), 0.5, False)          # a slot that never held a page: no wait
    assert tr.in_flight and tr.waited == 0
    cold.remove([0])                           # freed while its copy is in flight: fenced
    cold.put(3, *page(3), 0.5, False)          # reuses that slot (LIFO): waits first
    assert not tr.in_flight and tr.waited == 1
    cold.prefetch([1])
    cold.remove([1])
    tr.wait()                                  # waited before the slot is reused: no second wait
    cold.put(4, *page(4), 0.5, False)
    assert tr.waited == 2 and not tr.in_flight
