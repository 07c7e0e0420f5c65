"""The cold tier of the pruned KV cache: evicted pages in host memory (pinned when the hot tier is
on CUDA), with key summaries that let the newest queries bound each page's attention (Quest, Tang
et al. 2024) before it is recalled, and `PageTransfer`, the copies of prefetched pages back to the
device on a side CUDA stream."""
from __future__ import annotations

import math
from contextlib import nullcontext

import torch

from .model import ModelArgs

__all__ = ["ColdTier", "PageTransfer"]


class PageTransfer:
    """Copies of cold pages to the compute device, overlapped with compute on CUDA.

    On CUDA, `start()` issues non-blocking copies from the cold tier's pinned host memory on a side
    stream and records an event; `wait()` makes the compute stream wait for that event (a device-side
    wait: the host does not block) and does nothing when no copy is in flight. The cache calls
    `wait()` only where it must: before it reads the copies, and before the cold tier overwrites
    host memory a copy may still be reading. On the CPU the copies are plain and synchronous, with
    the same bookkeeping, so CPU tests check when copies are issued and waited for.

    Attributes:
        in_flight: copies issued and not yet waited for.
        issued: batches issued; waited: waits done (both since construction).
    Args:
        device: the compute device (torch.device or string; None: CPU).
    """

    def __init__(self, device=None):
        self.device = torch.device(device or "cpu")
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._event = None
        self._out: list[torch.Tensor] = []
        self.in_flight = False
        self.issued = 0
        self.waited = 0

    def start(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Issue copies of host `tensors` to the device; returns the device tensors (not to be read
        before `wait()`)."""
        ctx = torch.cuda.stream(self.stream) if self.stream is not None else nullcontext()
        with ctx:
            out = [t.to(self.device, non_blocking=True) for t in tensors]
            if self.stream is not None:  # recorded after every copy issued so far on the side stream
                self._event = torch.cuda.Event()
                self._event.record(self.stream)
        self._out += out
        self.in_flight = True
        self.issued += 1
        return out

    def wait(self) -> None:
        """Order the compute stream after the copies in flight (no-op when none are)."""
        if not self.in_flight:
            return
        if self.stream is not None:
            compute = torch.cuda.current_stream(self.device)
            compute.wait_event(self._event)
            for t in self._out:  # allocated on the side stream, read on the compute stream
                t.record_stream(compute)
        self._out, self._event, self.in_flight = [], None, False
        self.waited += 1


class ColdTier:
    """Bounded host-memory store of evicted pages, with key summaries for recall scoring.

    Storage per page slot: k, v [L, Hkv, page, D] (host, pinned when the cache is on CUDA),
    pos [page] int64, count (valid tokens), score (at eviction), superseded flag; key min, max
    and mean [L, Hkv, D, max_pages] on the compute device (slot last: scoring every page is one
    matmul with no gather).

    Attributes:
        transfer: the `PageTransfer` of `prefetch()`. A slot freed while its copies are in flight
            is fenced: `put()` waits for them before it rewrites that slot, and only then.
    """

    def __init__(self, args: ModelArgs, tokens: int, page: int, dtype, device):
        self.page = page
        self.max_pages = tokens // page
        cuda = torch.device(device or "cpu").type == "cuda"
        shape = (self.max_pages, args.n_layers, args.n_kv_heads, page, args.head_dim)
        # uninitialised: a slot is read only up to the count `put` wrote (no pages touched before,
        # so a session starts without writing its whole cold tier: ~190 MB for SmolLM2 at 4096 tokens)
        self.k = torch.empty(shape, dtype=dtype, device="cpu", pin_memory=cuda)
        self.v = torch.empty(shape, dtype=dtype, device="cpu", pin_memory=cuda)
        self.pos = torch.zeros(self.max_pages, page, dtype=torch.long, device="cpu")
        self.count = torch.zeros(self.max_pages, dtype=torch.long, device="cpu")
        self.score = torch.zeros(self.max_pages, device="cpu")
        self.superseded = torch.zeros(self.max_pages, dtype=torch.bool, device="cpu")
        summary = (args.n_layers, args.n_kv_heads, args.head_dim, self.max_pages)
        self.kmin = torch.zeros(summary, dtype=torch.float32, device=device)
        self.kmax = torch.zeros(summary, dtype=torch.float32, device=device)
        self.kmean = torch.zeros(summary, dtype=torch.float32, device=device)
        self.slot_of: dict[int, int] = {}     # page id (position // page) -> storage slot
        self.free = list(range(self.max_pages - 1, -1, -1))
        self.transfer = PageTransfer(device)
        self._fenced: set[int] = set()        # slots freed while copies were in flight

    @property
    def tokens(self) -> int:
        return int(self.count.sum())

    def put(self, pid: int, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, score: float,
            superseded: bool) -> int:
        """Store page `pid` (k, v [L, Hkv, c, D] on the compute device, pos [c]); returns tokens
        dropped to make room (the victim is a superseded page first, then the lowest score)."""
        dropped = 0
        if pid in self.slot_of:  # the kept head of a page cut by a rollback: replaced by its new copy
            dropped = int(self.count[self.slot_of[pid]])
            self.remove([pid])
        if not self.free:
            used = torch.tensor(list(self.slot_of.values()), device="cpu")
            key = self.score[used] - 1e9 * self.superseded[used].float()
            victim = int(used[int(key.argmin())])
            dropped += int(self.count[victim])
            self.remove([p for p, s in self.slot_of.items() if s == victim])
        s = self.free.pop()
        if s in self._fenced and self.transfer.in_flight:  # a copy in flight may still read this slot
            self.transfer.wait()
        c = pos.shape[0]
        self.k[s, :, :, :c].copy_(k)
        self.v[s, :, :, :c].copy_(v)
        self.pos[s, :c] = pos.cpu()
        self.count[s], self.score[s], self.superseded[s] = c, score, superseded
        kf = k.float()
        self.kmin[..., s], self.kmax[..., s], self.kmean[..., s] = kf.amin(dim=2), kf.amax(dim=2), kf.mean(dim=2)
        self.slot_of[pid] = s
        return dropped

    def remove(self, pids) -> None:
        """Forget pages `pids` (their slots become free)."""
        if not self.transfer.in_flight:
            self._fenced.clear()
        for pid in pids:
            s = self.slot_of.pop(pid)
            self.count[s] = 0
            self.free.append(s)
            if self.transfer.in_flight:
                self._fenced.add(s)

    def prefetch(self, pids: list[int]) -> list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Start copying the stored pages `pids` to the compute device (on CUDA: a side stream).

        Returns:
            [(pid, k, v, pos)] with k, v [L, Hkv, c, D] on the device (read them only after
            `transfer.wait()`) and pos [c] int64 (host).
        """
        slots = [self.slot_of[p] for p in pids]
        # whole slots: contiguous in pinned memory, so the copies need no pageable staging buffer
        copies = self.transfer.start([x for s in slots for x in (self.k[s], self.v[s])])
        out = []
        for i, (pid, s) in enumerate(zip(pids, slots)):
            c = int(self.count[s])
            out.append((pid, copies[2 * i][:, :, :c], copies[2 * i + 1][:, :, :c], self.pos[s, :c].clone()))
        return out

    def truncate(self, n_tokens: int) -> None:
        """Forget every stored token at position >= n_tokens (rollback)."""
        for pid, s in list(self.slot_of.items()):
            keep = int((self.pos[s, :int(self.count[s])] < n_tokens).sum())
            if keep == 0:
                self.remove([pid])
            else:
                self.count[s] = keep  # min/max over the old superset still bound the keys

    def page_scores(self, pids: list[int], q: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Quest upper bound and key-centroid score (both minus log-sum-exp, best over layers,
        heads and queries) of each of the stored pages `pids`.

        q: [L, H, R, D] fp32 queries, lse: [L, H, R]. Returns (bound [P], centroid [P]) fp32.
        """
        slots = torch.tensor([self.slot_of[p] for p in pids], device=self.kmin.device)
        L, H, R, D = q.shape
        Hkv = self.kmin.shape[1]
        qg = q.reshape(L, Hkv, (H // Hkv) * R, D)
        ub = (qg.clamp(min=0) @ self.kmax + qg.clamp(max=0) @ self.kmin) / math.sqrt(D)  # [L, Hkv, G*R, pages]
        mean = (qg @ self.kmean) / math.sqrt(D)
        ref = lse.reshape(L, Hkv, -1, 1)
        return (ub - ref).amax(dim=(0, 1, 2))[slots], (mean - ref).amax(dim=(0, 1, 2))[slots]

    def exact_scores(self, kp: torch.Tensor, counts: torch.Tensor, q: torch.Tensor,
                     lse: torch.Tensor) -> torch.Tensor:
        """Best softmax probability any token of each page gets from any (layer, head, query).

        kp: [P, L, Hkv, page, D] keys, counts: [P] valid tokens, q: [L, H, R, D], lse [L, H, R].
        Returns [P] fp32.
        """
        P, L, Hkv, page, D = kp.shape
        qg = q.reshape(L, Hkv, -1, D)                                      # [L, Hkv, G*R, D]
        s = torch.einsum("lhqd,plhtd->plhqt", qg, kp.float()) / math.sqrt(D)
        s = s - lse.reshape(L, Hkv, -1, 1).to(s.device)
        valid = torch.arange(page, device=s.device) < counts.to(s.device).view(P, 1)
        s = s.masked_fill(~valid.view(P, 1, 1, 1, page), float("-inf"))
        return s.amax(dim=(1, 2, 3, 4)).exp()
