"""`tokenspeed draft eval`: acceptance per drafter on the held-out split, through the real loop.

Every held-out conversation is replayed with `Session.decide()` under several speculation
settings - plain (no drafter: jump-forward only), prompt lookup, the draft model, and both - at a
fixed proposal length (so acceptance is measured, not hidden by adaptivity), then with the
default adaptive setting for timing. Reported per setting:

- acceptance_rate: accepted / proposed draft tokens (grammar-forced tokens are not drafts),
  also per source (lookup, model);
- decided_tokens: output tokens the model had to decide (not forced by the grammar), and
  draft_coverage: the share of them that came from accepted drafts;
- mean_accept_len: tokens emitted per target forward (accepted drafts + the target's own token;
  forced tokens excluded) and tokens_per_forward (all output tokens, forced included);
- identical: outputs equal to plain greedy (must be all);
- total_ms / itl_ms medians over repeats (this machine is shared and noisy).

`verify_cost` measures the target forward time against the number of tokens verified at once:
the basis for a single chain rather than a token tree (a tree verifies more tokens per forward).

`analyze` (`--analyze`, seconds instead of minutes) is teacher-forced: for every decided held-out
token it asks each drafter what it would propose after the true prefix, under the grammar mask.
In a greedy chain every proposal up to the first rejection sees exactly that prefix, so this is
the per-proposal acceptance of the loop. It breaks misses down by token class, gives the draft
model's acceptance and coverage per confidence gate (`SpecConfig.min_confidence`), and its top-2
agreement (what a width-2 token tree could add).
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path

from tqdm import tqdm

import numpy as np
import torch

from ..speculation import DraftModel, PromptLookup, SpecConfig, Speculator, copy_source
from .data import read_data
from .train import context_view

__all__ = ["evaluate", "verify_cost", "analyze"]


def _settings(draft: DraftModel | None, k: int) -> dict[str, SpecConfig | None]:
    s = {"plain": None, "lookup": SpecConfig(draft=None, max_k=k, adaptive=False)}
    if draft is not None:
        s["model"] = SpecConfig(prompt_lookup=False, draft=draft, max_k=k, adaptive=False)
        s["lookup+model"] = SpecConfig(draft=draft, max_k=k, adaptive=False)
        s["adaptive"] = SpecConfig(draft=draft)
    else:
        s["adaptive"] = SpecConfig(draft=None)
    return s


def evaluate(engine, data: Path, draft: DraftModel | None, *, k: int = 6, limit: int | None = None,
             repeats: int = 1, families: list[str] | None = None, progress: bool = True) -> dict:
    """Replay the held-out split under each speculation setting and report (see module doc).

    Args:
        engine: the target `Engine`. data: dataset file. draft: the draft model or None.
        k: fixed proposal length for the acceptance settings.
        limit: most held-out rows per task family. repeats: timing repeats per row and setting.
        families: restrict to these task families (robot, trading, bfcl). Agent-session rows are
            not replayed here (each needs its whole session replayed: `tokenspeed draft speedup`
            runs the AAL turns).
    Returns:
        {"rows": n, "settings": {name: metrics}}.
    Raises:
        ValueError: k or repeats < 1; not a dataset file.
    """
    if k < 1 or repeats < 1:
        raise ValueError(f"eval: need k >= 1 and repeats >= 1 (got k={k}, repeats={repeats})")
    _, rows = read_data(data, "heldout")
    rows = [r for r in rows if r["family"] != "agent"]
    picked, per_family = [], {}
    for r in rows:
        n = per_family.get(r["family"], 0)
        if (families is None or r["family"] in families) and (limit is None or n < limit):
            per_family[r["family"]] = n + 1
            picked.append(r)
    rows = picked
    saved = engine.speculation
    settings = _settings(draft, k)
    stats = {name: {"proposed": 0, "accepted": 0, "by_source": {}, "decided": 0, "output": 0, "forwards": 0,
                    "identical": 0, "total_ms": [], "itl_ms": []} for name in settings}
    plain_text: dict[str, str] = {}
    key = s = start = None
    speculators: dict[str, Speculator] = {}  # per setting, kept over the rows of one conversation
    try:
        for r in tqdm(rows, desc="draft eval", unit="row", disable=not progress):
            if json.dumps([r["system"], r["tools"]], sort_keys=True) != key:  # new system prompt/tools
                key = json.dumps([r["system"], r["tools"]], sort_keys=True)
                engine.speculation = None
                s = engine.session(system=r["system"], tools=r["tools"])
                start = s.checkpoint()
                speculators = {name: Speculator(cfg, s.model.args.max_seq_len) for name, cfg in settings.items()}
            for name in settings:
                s.speculator = speculators[name]  # one session (one prefill) serves every setting
                s.rollback(start)
                for m in r["messages"]:
                    s.observe(m)
                s.speculator.observe(s.tokens)  # draft prefill at observation time, not in decide()
                cp = s.checkpoint()
                for rep in range(repeats):
                    s.rollback(cp)
                    d = s.decide(max_tokens=128)
                    st = stats[name]
                    st["total_ms"].append(d.total_s * 1e3)
                    st["itl_ms"] += [x * 1e3 for x in d.itl_s]
                    if rep:
                        continue
                    n_out = d.forced_tokens + d.generated_tokens  # a tool call ends by grammar, not a stop token
                    st["proposed"] += d.draft_tokens
                    st["accepted"] += d.accepted_tokens
                    for src, (p, a) in d.draft_sources.items():
                        bs = st["by_source"].setdefault(src, [0, 0])
                        bs[0] += p
                        bs[1] += a
                    st["forwards"] += d.forwards
                    st["decided"] += d.generated_tokens
                    st["output"] += n_out
                    if name == "plain":
                        plain_text[r["id"]] = d.text
                    st["identical"] += d.text == plain_text.get(r["id"])
    finally:
        engine.speculation = saved
    report = {}
    plain_ms = statistics.median(stats["plain"]["total_ms"]) if rows else None
    for name, st in stats.items():
        fw = max(st["forwards"], 1)
        report[name] = {
            "acceptance_rate": st["accepted"] / st["proposed"] if st["proposed"] else None,
            "by_source": {src: {"proposed": p, "accepted": a, "rate": a / p if p else None}
                          for src, (p, a) in st["by_source"].items()},
            "proposed": st["proposed"], "accepted": st["accepted"],
            "decided_tokens": st["decided"],
            "draft_coverage": st["accepted"] / st["decided"] if st["decided"] else None,
            "forwards": st["forwards"],
            "mean_accept_len": st["decided"] / fw,
            "tokens_per_forward": st["output"] / fw,
            "identical": f"{st['identical']}/{len(rows)}",
            "total_ms_p50": statistics.median(st["total_ms"]) if st["total_ms"] else None,
            "itl_ms_p50": statistics.median(st["itl_ms"]) if st["itl_ms"] else None,
            "speedup_vs_plain": plain_ms / statistics.median(st["total_ms"]) if st["total_ms"] and plain_ms else None,
        }
    return {"rows": len(rows), "k": k, "repeats": repeats, "settings": report}


def verify_cost(engine, sizes=(1, 2, 4, 8, 16), context: int = 600, repeats: int = 7) -> dict:
    """Median milliseconds of one target forward over T new tokens after `context` cached tokens.

    Returns {T: ms}. Random token ids (cost does not depend on them).
    """
    import time

    import torch

    model = engine.model
    cache = model.new_cache(context + max(sizes))
    ids = torch.randint(0, engine.args.vocab_size, (context + max(sizes),))
    model(ids[:context], torch.arange(context), cache, "none")
    out = {}
    for T in sizes:
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            model(ids[context:context + T], torch.arange(context, context + T), cache, "all")
            times.append((time.perf_counter() - t0) * 1e3)
            cache.truncate(context)
        out[T] = round(statistics.median(times), 2)
    return out



def _token_class(text: str) -> str:
    if any(c.isdigit() for c in text):
        return "number"
    return "word" if text.strip().isalnum() else "punct"


@torch.no_grad()
def analyze(engine, data: Path, draft: DraftModel | None, *, config: SpecConfig | None = None,
            gates=(0.0, 0.5, 0.7, 0.8, 0.9, 0.95)) -> dict:
    """Teacher-forced rejection analysis of the held-out decided tokens (see module doc).

    Args:
        engine: the target `Engine` (tokenizer and grammars). data: dataset file.
        draft: the draft model or None. config: lookup settings and the combination rule
            (lookup_below, min_confidence) to score (default `SpecConfig()`).
        gates: confidence gates to tabulate for the draft model alone.
    Returns:
        {"tokens", "by_class": {class: {"tokens", "model", "model_top2", "lookup_proposed",
        "lookup_right", "combined_proposed", "combined_right"}}, "gates": {gate: {"coverage",
        "acceptance"}}, "combined": {"coverage", "acceptance"}} where coverage = right proposals
        / decided tokens and acceptance = right proposals / proposals.
    """
    from ..grammar import TokenMask, normalize_tools

    cfg = config or SpecConfig()
    lookup = PromptLookup(cfg.max_ngram, cfg.min_ngram, cfg.lookup_window)
    tok = engine.tokenizer
    mask = TokenMask(tok.vocab_size)
    _, rows = read_data(data, "heldout")
    recs = []  # (class, wanted id, model top-1 id, model top-2 id, confidence, lookup id or None)
    for r in rows:
        ids = np.asarray(r["prompt_ids"] + r["output_ids"], dtype=np.int64)
        p0 = len(r["prompt_ids"])
        matcher = engine.grammar(normalize_tools(r["tools"]), r.get("tool_choice", "required")).matcher()
        source = copy_source(ids, p0, set(tok.stop_ids))
        pos, allowed, looked = [], [], []
        for j, (t, forced) in enumerate(zip(r["output_ids"], r["forced"])):
            if not forced:
                pos.append(p0 + j - 1)
                allowed.append(mask.allowed(matcher))
                x = lookup.propose(ids[:p0 + j], source)
                looked.append(x if x is not None and matcher.validate_tokens([x]) == 1 else None)
            matcher.consume_token(t)
        if not pos:
            continue
        if draft is not None:  # over the part of the context the draft attends to (its window)
            cut = p0 - len(context_view(r["prompt_ids"], draft.window, None))
            seen = torch.from_numpy(ids[cut:])
            logits = draft.net(seen, torch.arange(len(seen)), draft.net.new_cache(len(seen)),
                               torch.tensor(pos) - cut)
            logits = logits.float().masked_fill(~torch.stack(allowed)[:, draft.vocab], float("-inf"))
            p2, i2 = torch.softmax(logits, -1).topk(2, -1)
            top = draft.vocab[i2].tolist()
            conf = p2[:, 0].tolist()
        else:
            top, conf = [[None, None]] * len(pos), [0.0] * len(pos)
        for i, p in enumerate(pos):
            want = int(ids[p + 1])
            recs.append((_token_class(tok.decode([want])), want, top[i][0], top[i][1], conf[i], looked[i]))

    def combined(rec) -> int | None:  # Speculator.chain's rule for one position
        _, _, m1, _, c, look = rec
        if m1 is None:
            return look
        if look is None:
            return m1 if c >= cfg.min_confidence else None
        return m1 if c >= cfg.lookup_below else look

    n = len(recs)
    by_class = {}
    for cls in ("number", "word", "punct", "all"):
        rs = [x for x in recs if cls in ("all", x[0])]
        comb = [combined(x) for x in rs]
        by_class[cls] = {
            "tokens": len(rs),
            "model": sum(x[2] == x[1] for x in rs), "model_top2": sum(x[1] in (x[2], x[3]) for x in rs),
            "lookup_proposed": sum(x[5] is not None for x in rs), "lookup_right": sum(x[5] == x[1] for x in rs),
            "combined_proposed": sum(c is not None for c in comb),
            "combined_right": sum(c == x[1] for c, x in zip(comb, rs)),
        }
    gate_table = {}
    for g in gates:
        prop = [x for x in recs if x[2] is not None and x[4] >= g]
        right = sum(x[2] == x[1] for x in prop)
        gate_table[g] = {"coverage": round(right / max(n, 1), 3), "acceptance": round(right / max(len(prop), 1), 3)}
    a = by_class["all"]
    return {"tokens": n, "by_class": by_class, "gates": gate_table,
            "combined": {"lookup_below": cfg.lookup_below, "min_confidence": cfg.min_confidence,
                         "coverage": round(a["combined_right"] / max(n, 1), 3),
                         "acceptance": round(a["combined_right"] / max(a["combined_proposed"], 1), 3)}}
