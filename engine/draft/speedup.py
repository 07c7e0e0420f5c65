"""`tokenspeed draft speedup`: decision latency with and without speculation on the AAL turns.

The AAL workload (`tokenspeed.bench.workload.build_workload`) is replayed in one session: before
each turn its observations are prefilled, then the turn's decision is made `repeats` times under
every setting, alternating the order of the settings between repeats (the machine is shared, so
load drift hits all settings alike), rolling back to the turn's checkpoint in between. The draft
model prefills the observations when they arrive (`Speculator.observe`), as the target does, not
inside the timed decision. The last
decision stays in the context, as an agent keeps its own calls.

Settings: "plain" (no drafter; grammar jump-forward only), "spec" (the default speculation:
prompt lookup + draft model, adaptive proposal length), "lookup" (prompt lookup alone, adaptive;
when a draft is given), plus any extra `SpecConfig`s given.
Reported per setting: the median decide() time per turn, their sum (turn_ms), the median
inter-token latency over all decisions (itl_ms_p50; amortised over the tokens a verification
emits), forwards, acceptance, and the speed-ups turn_ms(plain) / turn_ms(setting) and
itl_ms_p50(plain) / itl_ms_p50(setting). `identical` counts decisions whose text equals plain's.
"""
from __future__ import annotations

import statistics

from tqdm import tqdm

from ..speculation import DraftModel, SpecConfig, Speculator

__all__ = ["speedup"]


def speedup(engine, draft: DraftModel | None, *, seed: int = 0, quick: bool = False, n_calls: int | None = None,
            repeats: int = 5, extra: dict[str, SpecConfig] | None = None, progress: bool = True) -> dict:
    """Measure decision latency on the AAL turns with and without speculation (see module doc).

    Args:
        engine: the target `Engine` (set its threads when loading; timings are per this process).
        draft: the draft model for the "spec" setting, or None (prompt lookup and grammar runs only).
        seed, quick, n_calls: the workload (`build_workload`'s arguments).
        repeats: decisions per turn and setting (medians are reported).
        extra: more settings {name: SpecConfig} to measure beside "plain" and "spec".
    Returns:
        {"turns", "repeats", "settings": {name: metrics}, "per_turn_ms": {name: [median ms per turn]},
        "spec_forward_ms": {T: the "spec" setting's fitted target forward time over T tokens}}.
    Raises:
        ValueError: repeats < 1.
    """
    from ..bench.workload import build_workload

    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    wl = build_workload(seed=seed, quick=quick, n_calls=n_calls)
    settings: dict[str, SpecConfig | None] = {"plain": None, "spec": SpecConfig(draft=draft), **(extra or {})}
    if draft is not None:
        settings.setdefault("lookup", SpecConfig(draft=None))
    names = list(settings)
    saved, engine.speculation = engine.speculation, None
    try:
        s = engine.session(system=wl.system, tools=wl.tools)
    finally:
        engine.speculation = saved
    speculators = {name: Speculator(cfg, s.model.args.max_seq_len) for name, cfg in settings.items()}
    st = {name: {"turn_ms": [], "itl_ms": [], "forwards": 0, "decided": 0, "forced": 0, "proposed": 0,
                 "accepted": 0, "identical": 0} for name in names}
    for turn in tqdm(wl.turns, desc="speedup", unit="turn", disable=not progress):
        for o in turn.observations:
            s.observe(o.content, role=o.role, kind=o.kind, source=o.source)
        for sp in speculators.values():  # the draft's KV follows observations (`Speculator.observe`)
            sp.observe(s.tokens)
        cp = s.checkpoint()
        times = {name: [] for name in names}
        texts = {}
        for rep in range(repeats):
            for name in (names if rep % 2 == 0 else names[::-1]):
                s.rollback(cp)
                s.speculator = speculators[name]
                d = s.decide(tool_choice=turn.tool_choice, max_tokens=wl.max_tokens)
                times[name].append(d.total_s * 1e3)
                st[name]["itl_ms"] += [x * 1e3 for x in d.itl_s]
                if rep == 0:
                    texts[name] = d.text
                    st[name]["forwards"] += d.forwards
                    st[name]["decided"] += d.generated_tokens
                    st[name]["forced"] += d.forced_tokens
                    st[name]["proposed"] += d.draft_tokens
                    st[name]["accepted"] += d.accepted_tokens
        for name in names:
            st[name]["turn_ms"].append(statistics.median(times[name]))
            st[name]["identical"] += texts[name] == texts["plain"]
        # The context keeps the last decision made (its text equals plain's when identical).
    report = {}
    plain = st["plain"]
    for name, x in st.items():
        itl = statistics.median(x["itl_ms"]) if x["itl_ms"] else None
        report[name] = {
            "turn_ms": round(sum(x["turn_ms"]), 1),
            "itl_ms_p50": None if itl is None else round(itl, 2),
            "forwards": x["forwards"], "decided_tokens": x["decided"], "forced_tokens": x["forced"],
            "decided_per_forward": round(x["decided"] / max(x["forwards"], 1), 3),
            "acceptance_rate": round(x["accepted"] / x["proposed"], 3) if x["proposed"] else None,
            "identical": f"{x['identical']}/{len(wl.turns)}",
            "turn_speedup": round(sum(plain["turn_ms"]) / sum(x["turn_ms"]), 3),
            "itl_speedup": round(statistics.median(plain["itl_ms"]) / itl, 3) if itl and plain["itl_ms"] else None,
        }
    length = speculators["spec"].length  # its fitted target forward cost (what the value test uses)
    return {"turns": len(wl.turns), "repeats": repeats, "settings": report,
            "spec_forward_ms": {T: round(length.forward_s(T) * 1e3, 1) for T in (1, 2, 4, 8, 16, 32)},
            "per_turn_ms": {name: [round(v, 1) for v in x["turn_ms"]] for name, x in st.items()}}
