"""Relevance-pruned, tiered KV cache: a bounded hot tier on the compute device, a bounded cold
tier in host memory, and query-aware recall between them.

- Relevance: each slot accumulates the attention mass it receives (H2O, Zhang et al. 2023), decayed
  per new token (Scissorhands, Liu et al. 2023); one score per token, shared by all layers.
- Never evicted: attention sinks (StreamingLLM, Xiao et al. 2023), pinned segments (system prompt,
  tools; of pinned observations, the newest per source), the `recent` newest tokens. Eviction moves whole pages (Quest, Tang et al. 2024):
  superseded sensor readings first, then the lowest page score.
- Cold tier: evicted pages in host memory (pinned on CUDA) with key min/max/mean summaries. Recall:
  the newest queries bound each cold page's score (Quest), the best by key centroid are prefetched
  (on CUDA, copied on a side stream while the GPU computes: `PageTransfer`), and the exact scores
  decide before the next forward which come back (with the rest of their segment).
- Positions: keys keep their original rotation, so a kept or recalled slot is bit-identical to
  the full cache's; slot order is free (eviction fills holes, recall appends).
- Rollback: `snapshot()`/`restore()` bring back the recorded hot set in its slot order.
- Decisions: inside `decision()` forwards do not prefetch; the call is decoded over the hot set
  its question recalled. Decisions never evict unless the cache is full.

The cache answers the same methods as the plain `KVCache` (`tokenspeed.model`), so sessions use
either without branching. Measurements behind these choices: README, "Relevance-pruned KV cache".
"""
from __future__ import annotations

import bisect
import math
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from .cold_tier import ColdTier
from .device import to_device
from .model import KVCache, ModelArgs

__all__ = ["KVConfig", "TieredKVCache", "ColdTier"]


@dataclass
class KVConfig:
    """Pruning and tiering settings for one session (all sizes in tokens).

    Attributes:
        budget: hot-tier tokens kept after each observe().
        cold: cold-tier capacity (host memory); 0 drops evicted entries.
        recent: newest tokens always kept; None (default) = budget // 2, H2O's even split between
            recent and heavy-hitter tokens (the model needs a coherent recent window).
        sinks: first tokens always kept (attention sinks).
        page: tokens per eviction/recall page.
        decay: per-new-token decay of relevance scores, in (0, 1].
        recall_threshold: softmax probability a cold page must be able to reach to be recalled.
        max_recall_pages: pages recalled at most per forward (plus the rest of their observations).
        recall_queries: newest tokens of a forward whose queries score the cold pages.
        reserve: extra hot capacity for prefill chunks and decisions before eviction is forced.
        recall_room: tokens above `budget` that recalled pages may fill (None: up to budget +
            reserve). Recalls during a decision otherwise grow the hot tier towards its capacity,
            and every decode step attends over it.
    Raises (on construction):
        ValueError: a size or rate is out of range.
    """

    budget: int
    cold: int = 4096
    recent: int | None = None
    sinks: int = 4
    page: int = 16
    decay: float = 0.995
    recall_threshold: float = 0.1
    max_recall_pages: int = 2
    recall_queries: int = 8
    reserve: int = 768
    recall_room: int | None = None

    def __post_init__(self):
        if isinstance(self.budget, bool) or not isinstance(self.budget, int) or self.budget < 1:
            raise ValueError(f"KVConfig: budget must be a positive int (tokens), got {self.budget!r}")
        if self.recent is None:
            self.recent = self.budget // 2
        if self.page < 1 or self.recent < self.page or self.sinks < 0:
            raise ValueError(f"KVConfig: need page >= 1, recent >= page, sinks >= 0 (got {self})")
        if self.budget < self.sinks + self.recent + 2 * self.page:
            raise ValueError(f"KVConfig: budget {self.budget} must exceed sinks + recent + 2 pages "
                             f"({self.sinks + self.recent + 2 * self.page} tokens)")
        if self.cold < 0 or self.reserve < self.page or self.max_recall_pages < 0 or self.recall_queries < 1:
            raise ValueError(f"KVConfig: need cold >= 0, reserve >= page, max_recall_pages >= 0, "
                             f"recall_queries >= 1 (got {self})")
        if self.recall_room is not None and self.recall_room < 0:
            raise ValueError(f"KVConfig: recall_room must be >= 0 or None (got {self.recall_room})")
        if not 0.0 < self.decay <= 1.0 or not 0.0 < self.recall_threshold < 1.0:
            raise ValueError(f"KVConfig: decay in (0, 1], recall_threshold in (0, 1) (got {self})")


@dataclass(frozen=True)
class KVSnapshot:
    """Hot-tier state for rollback: positions [n] int64 and scores [n] fp32 (host copies)."""

    pos: torch.Tensor
    score: torch.Tensor


class TieredKVCache(KVCache):
    """A `KVCache` whose hot tier is bounded by relevance pruning, backed by a `ColdTier`.

    Sessions create it through `Engine.session(kv_budget=...)`; they append their `Segment`s to
    `segments` (pins and sensor supersession come from them).

    Args:
        args: model architecture. config: a `KVConfig`. dtype/device: like `KVCache`.
    """

    tracks_attention = True

    def __init__(self, args: ModelArgs, config: KVConfig, dtype=torch.float32, device=None):
        super().__init__(args, config.budget + config.reserve, dtype, device)
        self.config = config
        self.args = args
        self.register_buffer("score", torch.zeros(self.capacity, dtype=torch.float32, device=device),
                             persistent=False)
        self.cold = ColdTier(args, config.cold, config.page, dtype, device) if config.cold else None
        self._q: list[torch.Tensor | None] = [None] * args.n_layers    # last queries per layer [H, R, D]
        self._lse: list[torch.Tensor | None] = [None] * args.n_layers  # their log-sum-exp [H, R]
        self._staged: list = []      # prefetched pages (pid, k, v, pos) awaiting the exact check
        self._staged_q = None        # the queries and log-sum-exp that shortlisted them
        self._in_decision = False    # no prefetch while a decision() runs
        self.totals = dict(evicted=0, recalled=0, cold_dropped=0, prefetch_hits=0, prefetch_misses=0,
                           rollback_lost=0)
        self._since = dict(self.totals)

    # ------------------------------------------------------------ model hooks

    def record_attention(self, layer: int, q: torch.Tensor, mass: torch.Tensor, lse: torch.Tensor) -> None:
        """Add one layer's attention mass (slots [0, S)) to the relevance scores; q [1, H, T, D]."""
        T, S = q.shape[2], mass.shape[0]
        if layer == 0:
            start = S - T
            self.score[:start] *= self.config.decay ** T
            self.score[start:S] = 0.0
        self.score[:S] += mass / (self.args.n_layers * self.args.n_heads)
        if self.cold is not None and self.cold.slot_of:
            r = min(T, self.config.recall_queries)  # the newest tokens' queries
            self._q[layer] = q[0, :, -r:].float().clone()
            self._lse[layer] = lse[:, -r:].clone()
            if layer == self.args.n_layers - 1 and not self._in_decision:
                self._prefetch()

    def prepare(self, T: int) -> None:
        """Before a forward of T tokens: merge in prefetched pages that pass the exact relevance
        check, then evict if the cache has no room (forced eviction, never of pinned/recent)."""
        if self._staged:
            self._recall()
        if self.n + T > self.capacity:
            self.evict_to(self.capacity - T)
        super().prepare(T)  # raises if pinned and recent tokens alone leave no room

    def admit(self, n_context: int, n_new: int) -> None:
        """Any context fits: the hot tier is pruned to the budget, the rest is tiered."""

    @contextmanager
    def decision(self):
        """Scope of one decision: its forwards do not prefetch, so the decision runs over the hot
        set its question recalled (see the module docstring, "Decisions")."""
        self._in_decision = True
        try:
            yield
        finally:
            self._in_decision = False

    # ------------------------------------------------------------ policy

    def trim(self) -> None:
        """Evict down to the budget (called after each observe())."""
        if self.n > self.config.budget:
            self.evict_to(self.config.budget)

    def _slot_classes(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # pinned [n] bool and superseded [n] bool for hot positions, from the session's segments.
        segs = self.segments
        pinned = pos < self.config.sinks
        superseded = torch.zeros_like(pinned)
        if not segs:
            return pinned, superseded
        starts = torch.tensor([s.start for s in segs], device=pos.device)
        # the newest pinned segment and the newest sensor reading of each source supersede the older
        # ones: an older pin loses its pin (a new goal replaces the last one), and both leave first
        seg_pin, seg_sup = [s.pinned for s in segs], [False] * len(segs)
        seen_pin, seen_sensor = set(), set()
        for i in range(len(segs) - 1, -1, -1):
            s = segs[i]
            if s.pinned and s.source:
                seg_sup[i] = s.source in seen_pin
                seg_pin[i] = not seg_sup[i]
                seen_pin.add(s.source)
            elif s.kind == "sensor" and s.source:
                seg_sup[i] = s.source in seen_sensor
                seen_sensor.add(s.source)
        idx = (torch.searchsorted(starts, pos, right=True) - 1).clamp(min=0)
        return (pinned | torch.tensor(seg_pin, device=pos.device)[idx],
                torch.tensor(seg_sup, device=pos.device)[idx])

    def evict_to(self, target: int, protect: torch.Tensor | None = None) -> None:
        """Move whole pages out of the hot tier until at most `target` slots remain.

        protect: optional [n] bool of slots that must stay. Pinned and recent tokens are never
        evicted, so more slots remain when they alone exceed `target`.
        """
        n, cfg = self.n, self.config
        if n <= target:
            return
        pos = self.pos[:n]
        pinned, superseded = self._slot_classes(pos)
        keep = pinned | (pos >= self.next_position() - cfg.recent)
        if protect is not None:
            keep |= protect
        pid = pos // cfg.page
        pages, inv = torch.unique(pid, return_inverse=True)
        P = pages.shape[0]
        zeros = torch.zeros(P, device=pos.device)
        page_keep = zeros.scatter_reduce(0, inv, keep.float(), "amax", include_self=False) > 0
        page_sup = zeros.scatter_reduce(0, inv, superseded.float(), "amin", include_self=False) > 0
        page_score = zeros.scatter_reduce(0, inv, self.score[:n], "amax", include_self=False)
        page_size = torch.bincount(inv, minlength=P)
        order = torch.argsort(page_score - 1e9 * page_sup.float())   # superseded first, then lowest score
        order = order[~page_keep[order]]
        need = n - target
        cum = page_size[order].cumsum(0)
        take = int(torch.searchsorted(cum, torch.tensor(need, device=cum.device))) + 1
        victims = order[:take]
        if victims.numel() == 0:
            return
        gone = torch.zeros(P, dtype=torch.bool, device=pos.device)
        gone[victims] = True
        out = gone[inv]
        if self.cold is not None:
            for p in victims.tolist():
                sl = (inv == p).nonzero().squeeze(1)
                sl = sl[torch.argsort(pos[sl])]  # the cold tier stores a page in position order
                self.totals["cold_dropped"] += self.cold.put(
                    int(pages[p]), self.k[:, 0, :, sl], self.v[:, 0, :, sl], pos[sl],
                    float(page_score[p]), bool(page_sup[p]))
        self.totals["evicted"] += int(out.sum())
        self._compact(~out)

    def _compact(self, keep: torch.Tensor) -> None:
        # Keep slots where keep [n] is True: the kept slots past the new end fill the holes below
        # it (O(dropped) moves; order is not preserved).
        m = int(keep.sum())
        holes = (~keep[:m]).nonzero().squeeze(1)
        movers = keep[m:].nonzero().squeeze(1) + m
        if holes.numel():
            self._move(movers, holes)
        self.n = m

    def _move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        # Copy slots src -> dst (index tensors [E]; read fully before writing).
        for buf in (self.k, self.v):
            buf[:, :, :, dst] = buf[:, :, :, src]
        self.pos[dst] = self.pos[src]
        self.score[dst] = self.score[src]

    def _insert(self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, score: torch.Tensor) -> None:
        # Append E entries (k, v [L, Hkv, E, D], pos [E], score [E]) after the hot slots.
        n, E = self.n, pos.shape[0]
        if n + E > self.capacity:
            raise ValueError(f"KV cache full: cannot insert {E} recalled tokens into {n}/{self.capacity}")
        for buf, new in ((self.k, k), (self.v, v)):
            buf[:, 0, :, n:n + E] = new.to(buf.device, buf.dtype)
        self.pos[n:n + E] = to_device(pos, self.pos.device)
        self.score[n:n + E] = to_device(score, self.score.device)
        self.n = n + E

    # ------------------------------------------------------------ recall

    def _prefetch(self) -> None:
        # After a forward: shortlist cold pages by their Quest bound and start copying them in.
        cfg, cold = self.config, self.cold
        q, lse = torch.stack(self._q), torch.stack(self._lse)            # [L, H, R, D], [L, H, R]
        # Superseded sensor readings stay cold: a newer reading of the same source replaced them.
        pids = list(cold.slot_of)
        slots = torch.tensor([cold.slot_of[p] for p in pids], device="cpu")
        pos, valid = cold.pos[slots], torch.arange(cfg.page, device="cpu") < cold.count[slots].unsqueeze(1)
        _, sup = self._slot_classes(pos.flatten().to(self.pos.device))
        sup = (sup.view(pos.shape).cpu() | ~valid).all(dim=1)
        pids = [p for p, x in zip(pids, sup.tolist()) if not x]
        if not pids:
            return
        bound, centroid = cold.page_scores(pids, q, lse)
        ok = bound > math.log(cfg.recall_threshold)
        if not bool(ok.any()):
            return
        cand = torch.argsort(centroid.masked_fill(~ok, float("-inf")), descending=True)[: 4 * cfg.max_recall_pages]
        cand = [pids[i] for i in cand.tolist() if bool(ok[i])]
        if not cand:
            return
        self._staged = cold.prefetch(cand)
        self._staged_q = (q, lse)

    def _recall(self) -> None:
        # Before a forward: keep the prefetched pages whose exact best probability passes.
        staged, self._staged = self._staged, []
        cfg, cold = self.config, self.cold
        cold.transfer.wait()  # the prefetched copies are read from here on
        staged = [st for st in staged if st[0] in cold.slot_of]  # the cold tier may have dropped some
        if not staged:
            return
        q, lse = self._staged_q
        page = cfg.page
        kp = torch.zeros(len(staged), *staged[0][1].shape[:2], page, staged[0][1].shape[-1],
                         dtype=self.k.dtype, device=self.k.device)
        counts = to_device(torch.tensor([s[3].shape[0] for s in staged], device="cpu"), self.k.device)
        for i, (_, k, _, _) in enumerate(staged):
            kp[i, :, :, :k.shape[2]] = k
        # The recall decision reads the exact scores on the host, once: which pages come back
        # decides the hot tier's size, which the forward needs.
        best = cold.exact_scores(kp, counts, q, lse).tolist()
        hits = [i for i in sorted(range(len(best)), key=best.__getitem__, reverse=True)
                if best[i] > cfg.recall_threshold][: cfg.max_recall_pages]
        self.totals["prefetch_hits"] += len(hits)
        self.totals["prefetch_misses"] += len(staged) - len(hits)
        # pid -> (k, v, pos, initial score): a hit page starts with its eviction score, at least
        # its predicted probability; the rest of its observation comes back with it, as one group
        # that is recalled whole or not at all (a fact cut off by the room limit is noise).
        chosen, groups, siblings = {}, [], []
        for i in hits:
            pid = staged[i][0]
            if pid in chosen:  # a sibling of an earlier hit
                continue
            chosen[pid] = (*staged[i][1:], max(float(cold.score[cold.slot_of[pid]]), best[i]))
            group = [pid]
            for sib in self._segment_pages(pid):
                if sib not in chosen and sib in cold.slot_of:
                    chosen[sib] = None  # copied below
                    group.append(sib)
            siblings += group[1:]
            groups.append(group)
        # the siblings are copied like the prefetched pages (on CUDA, on the side stream, non-blocking)
        for sib, k, v, pos in cold.prefetch(siblings) if siblings else ():
            chosen[sib] = (k, v, pos, float(cold.score[cold.slot_of[sib]]))
        limit = self.capacity if cfg.recall_room is None else min(self.capacity, cfg.budget + cfg.recall_room)
        room, take = limit - self.n, []
        for group in groups:
            size = sum(chosen[p][2].shape[0] for p in group)
            if size <= room:
                take += group
                room -= size
        if not take:
            return
        cold.transfer.wait()  # the siblings' copies are read from here on
        k = torch.cat([chosen[p][0] for p in take], dim=2)
        v = torch.cat([chosen[p][1] for p in take], dim=2)
        pos = torch.cat([chosen[p][2] for p in take])
        score = torch.cat([torch.full((chosen[p][2].shape[0],), chosen[p][3], device="cpu") for p in take])
        cold.remove(take)
        self._insert(k, v, pos, score)
        self.totals["recalled"] += pos.shape[0]

    def _segment_pages(self, pid: int) -> list[int]:
        # Pages of the (short, <= 8 pages) observations that overlap page `pid`.
        page, lo, hi = self.config.page, pid * self.config.page, (pid + 1) * self.config.page
        out = []
        i = bisect.bisect_right(self.segments, lo, key=lambda g: g.start) - 1
        for g in self.segments[max(i, 0):]:
            if g.start >= hi:
                break
            if g.end > lo and g.end - g.start <= 8 * page:
                out.extend(range(g.start // page, (g.end - 1) // page + 1))
        return out

    # ------------------------------------------------------------ rollback and metrics

    def snapshot(self) -> KVSnapshot:
        """Hot positions and scores, for `restore()` (O(hot tokens))."""
        return KVSnapshot(self.pos[:self.n].cpu().clone(), self.score[:self.n].cpu().clone())

    def restore(self, n_tokens: int, snap: KVSnapshot, keep: int = 0) -> int:
        """Return to the state at `snap`, whose context held `n_tokens` tokens, keeping up to
        `keep` of the tokens after them: positions [n_tokens, n_tokens + kept) where all of them
        are hot (a session's rollback that keeps a common prefix, `Session.observe`'s since).

        Drops hot and cold entries at later positions, moves pages recalled since the snapshot
        back to the cold tier, brings back pages evicted since (from the cold tier), and restores
        the snapshot's slot order and scores; the kept slots follow in position order, with
        scores 0. Returns how many tokens were kept.
        """
        self._staged = []
        hot = self.pos[:self.n].cpu()
        want_kept = torch.arange(n_tokens, n_tokens + max(keep, 0), device="cpu")
        held = torch.isin(want_kept, hot)
        kept = int(held.long().cumprod(0).sum())  # the run of hot positions from n_tokens on
        end = n_tokens + kept
        self._next = end  # the next token's position, whether or not the newest were kept
        self._compact(self.pos[:self.n] < end)
        if self.cold is not None:
            self.cold.truncate(end)
        page = self.config.page
        hot = self.pos[:self.n].cpu()
        extra = ~torch.isin(hot, snap.pos) & (hot < n_tokens)
        if bool(extra.any()):  # recalled after the snapshot: back to cold
            self.evict_to(0, protect=~extra.to(self.pos.device))
        missing = snap.pos[~torch.isin(snap.pos, self.pos[:self.n].cpu())]
        if missing.numel():
            want = torch.unique(missing // page).tolist()
            have = [p for p in want if self.cold is not None and p in self.cold.slot_of]
            if have:  # through the side stream on CUDA, like a recall: the host does not wait for the copies
                pages = self.cold.prefetch(have)
                self.cold.transfer.wait()
                for _, k, v, pos in pages:
                    self._insert(k, v, pos, torch.zeros(pos.shape[0], device="cpu"))
                self.cold.remove(have)
            self.totals["rollback_lost"] += int((~torch.isin(missing // page, torch.tensor(have, dtype=torch.long, device="cpu"))).sum())
        # Slot order: the snapshot's positions that are hot, in its order, then any others (tokens
        # sharing a page with a kept one) in their current order, then the kept ones in position order.
        hot = self.pos[:self.n].cpu()
        other = ~torch.isin(hot, snap.pos) & (hot < n_tokens)
        want = torch.cat([snap.pos[torch.isin(snap.pos, hot)], hot[other], want_kept[:kept]])
        if not torch.equal(want, hot):
            order = torch.argsort(hot)
            src = order[torch.searchsorted(hot[order], want)]
            dst = torch.arange(self.n, device="cpu")
            moved = src != dst
            self._move(src[moved].to(self.pos.device), dst[moved].to(self.pos.device))
            hot = want
        by_pos = torch.argsort(snap.pos)
        at = torch.searchsorted(snap.pos[by_pos], hot).clamp(max=snap.pos.shape[0] - 1)
        found = snap.pos[by_pos][at] == hot
        self.score[:self.n] = torch.where(found, snap.score[by_pos][at], torch.zeros((), device="cpu")).to(self.score.device)
        return kept

    def take_metrics(self) -> dict:
        """Sizes now and counters since the previous call (tokens, pages for prefetch).

        Keys: hot, cold (tokens), budget, evicted, recalled, cold_dropped (tokens),
        prefetch_hits, prefetch_misses (pages), rollback_lost (tokens), and totals (dict).
        """
        delta = {k: v - self._since[k] for k, v in self.totals.items()}
        self._since = dict(self.totals)
        return dict(hot=self.n, cold=self.cold.tokens if self.cold is not None else 0,
                    budget=self.config.budget, **delta, totals=dict(self.totals))
