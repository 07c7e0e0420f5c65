"""The co-located draft model: a small Llama on the target's frozen embeddings, its save/load, and
its per-session KV state (`DraftState`) that follows the session's token sequence.

Vocabulary reduction as in EAGLE-3 (Li et al. 2025) and FR-Spec (Zhao et al. 2025); trained by
self-distillation (DistillSpec, Zhou et al. 2024; recipe in `tokenspeed.draft`).
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ..device import to_device
from ..model import KVCache, ModelArgs, Transformer

__all__ = ["DraftModel", "DraftState", "fingerprint", "DEFAULT_DRAFT"]

DEFAULT_DRAFT = Path(__file__).parent.parent / "data" / "draft-smollm2-135m.safetensors"


class DraftModel(nn.Module):
    """A small Llama drafting for one target model, co-located in the same process and device.

    The draft is a `Transformer` whose token embedding module *is* the target's (shared, frozen)
    and whose output layer is a copy of the target's lm_head rows for a reduced vocabulary
    `vocab` [Vd] int64 (target ids). Only its decoder layers and final norm are trained and saved;
    the constructor leaves them uninitialized (`torch.empty`): build a draft with `load` or
    `init_from_target`, which set every one, or set them all before use.

    Attributes:
        net: the draft `Transformer` (logits [.., Vd] in draft-vocabulary order).
        vocab: [Vd] int64 target token ids of the draft's output rows (on the target's device).
        vocab_ids: the same ids as a host list.
        target_id: fingerprint of the target it was built for (see `fingerprint`).
        window: tokens of context the draft was trained to attend over (`DraftState`; sessions
            use it unless their KV budget is smaller), or None for the whole context.
    """

    def __init__(self, target: Transformer, args: ModelArgs, vocab: torch.Tensor):
        super().__init__()
        if args.dim != target.args.dim:
            raise ValueError(f"draft dim {args.dim} must equal the target's {target.args.dim} (shared embeddings)")
        # vocab_size is the draft's output vocabulary; its input embedding is the target's module.
        args = replace(args, vocab_size=len(vocab), tie_embeddings=False, max_seq_len=target.args.max_seq_len)
        with torch.device("meta"):
            net = Transformer(args)
            # the target's, set below: not allocated (and no init: normal_ on meta imports torch._dynamo)
            net.tok_embeddings = nn.Embedding(0, args.dim, _weight=torch.empty(0, args.dim))
        # torch.empty, not `to_empty`: empty_like of a meta tensor runs torch's Python reference
        # implementation, whose first use imports sympy (~0.5 s of every engine start)
        net = net._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=target.device)).to(target.dtype)
        # the same rotary arguments as the target's: its tables, not a second copy (4 MB at 8K positions)
        net.rope_cos, net.rope_sin = target.rope_cos, target.rope_sin
        # No init of the layers and final norm: `load` and `init_from_target` set every one (a random
        # init was 30-40 ms of every engine load, overwritten at once)
        with torch.no_grad():
            head = target.output  # an nn.Linear, or a quantized linear (tokenspeed.quant)
            rows = vocab.to(target.device)
            net.output.weight.copy_(head.dequantized(target.dtype, rows) if hasattr(head, "dequantized")
                                    else head.weight[rows])
        net.tok_embeddings = target.tok_embeddings
        net.output.weight.requires_grad_(False)
        net.tok_embeddings.requires_grad_(False)
        self.net = net
        self.register_buffer("vocab", vocab.to(device=target.device, dtype=torch.long), persistent=False)
        self.vocab_ids: list[int] = vocab.tolist()  # the same ids on the host (no device read per proposal)
        self.target_id = fingerprint(target)
        self.window: int | None = None

    @classmethod
    def init_from_target(cls, target: Transformer, vocab: torch.Tensor, n_layers: int = 1,
                         hidden_dim: int = 768) -> "DraftModel":
        """A fresh draft whose layers start as slices of the target's first layers.

        Args:
            target: the target model.
            vocab: [Vd] int64 target token ids the draft predicts.
            n_layers: draft decoder layers.
            hidden_dim: draft SwiGLU width (<= the target's; the target's first rows are copied).
        """
        t = target.args
        if not 1 <= n_layers <= t.n_layers or not 1 <= hidden_dim <= t.hidden_dim:
            raise ValueError(f"draft needs 1 <= n_layers <= {t.n_layers} and 1 <= hidden_dim <= {t.hidden_dim}")
        draft = cls(target, replace(t, n_layers=n_layers, hidden_dim=hidden_dim), vocab)
        h = hidden_dim
        with torch.no_grad():
            draft.net.norm.copy_(target.norm)
            for src, dst in zip(target.layers, draft.net.layers):
                dst.attention.load_state_dict(src.attention.state_dict())
                dst.attention_norm.copy_(src.attention_norm)
                dst.ffn_norm.copy_(src.ffn_norm)
                gate, up = src.feed_forward.w13.weight.split(t.hidden_dim)
                dst.feed_forward.w13.weight.copy_(torch.cat([gate[:h], up[:h]]))
                dst.feed_forward.w2.weight.copy_(src.feed_forward.w2.weight[:, :h])
        return draft

    def trainable_state(self) -> dict[str, torch.Tensor]:
        """The draft's own weights (layers and final norm): what `save` writes."""
        return {k: v for k, v in self.net.state_dict().items()
                if not k.startswith(("tok_embeddings.", "output."))}

    def save(self, path: str | Path, extra: dict | None = None) -> None:
        """Write the draft (fp16 weights, vocabulary, architecture, target fingerprint) as safetensors.

        extra: JSON-serialisable metadata to store alongside (e.g. training report).
        """
        import os

        from safetensors.torch import save_file

        a = self.net.args
        tensors = {k: v.detach().to(torch.float16).contiguous() for k, v in self.trainable_state().items()}
        tensors["draft.vocab"] = self.vocab.to(torch.int32).cpu()
        meta = {"n_layers": a.n_layers, "hidden_dim": a.hidden_dim, "target": self.target_id,
                "window": self.window, "extra": extra or {}}
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        save_file({k: v.cpu() for k, v in tensors.items()}, str(path), metadata={"tokenspeed_draft": json.dumps(meta)})
        os.chmod(path, 0o644)  # safetensors writes 0600; the draft is shared data

    @classmethod
    def load(cls, path: str | Path, target: Transformer) -> "DraftModel":
        """Load a draft saved by `save` for `target`.

        Raises:
            FileNotFoundError: no such file. ValueError: not a draft file, or built for another target.
        """
        from safetensors import safe_open

        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"draft model {path} does not exist or is not a file")
        try:
            with safe_open(str(path), "pt") as f:
                raw = (f.metadata() or {}).get("tokenspeed_draft")
                tensors = {k: f.get_tensor(k) for k in f.keys()}
        except Exception as exc:  # safetensors raises its own error types for corrupt files
            raise ValueError(f"{path} is not a readable safetensors file: {exc}") from exc
        if raw is None:
            raise ValueError(f"{path} is not a tokenspeed draft (no 'tokenspeed_draft' metadata)")
        try:
            meta = json.loads(raw)
            target_id, n_layers, hidden_dim = meta["target"], int(meta["n_layers"]), int(meta["hidden_dim"])
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{path}: malformed 'tokenspeed_draft' metadata ({exc})") from exc
        if target_id != fingerprint(target):
            raise ValueError(f"{path} was trained for another target model (fingerprint {target_id})")
        vocab = tensors.pop("draft.vocab", torch.empty(0)).long()
        if vocab.dim() != 1 or len(vocab) == 0 or int(vocab.min()) < 0 or int(vocab.max()) >= target.args.vocab_size:
            raise ValueError(f"{path}: draft.vocab must be target token ids in [0, {target.args.vocab_size})")
        draft = cls(target, replace(target.args, n_layers=n_layers, hidden_dim=hidden_dim), vocab)
        try:
            missing, unexpected = draft.net.load_state_dict(
                {k: v.to(device=target.device, dtype=target.dtype) for k, v in tensors.items()}, strict=False)
        except RuntimeError as exc:  # shape mismatches
            shape = str(exc).splitlines()[-1].strip()
            raise ValueError(f"{path}: weights do not fit the draft's architecture: {shape}") from exc
        own_missing = [k for k in missing if not k.startswith(("tok_embeddings.", "output."))]
        if own_missing or unexpected:
            raise ValueError(f"{path}: missing {own_missing}, unexpected {unexpected}")
        draft.meta = meta
        draft.window = meta.get("window")
        from ..quant import QUANTIZED, quantize

        if any(isinstance(m, QUANTIZED) for m in target.modules()):
            # A quantized target: the draft's linears go int8 too. Drafting between the target's
            # forwards reads the draft's weights from DRAM each time (the target evicts them from
            # the caches): 17 MB in fp32 took 2.0 ms per proposal, most of a drafting step.
            quantize(draft.net, "int8")
            draft.net.tok_embeddings = target.tok_embeddings  # still the target's table, as it is stored
        return draft.eval()

    def new_state(self, capacity: int, window: int | None = None) -> "DraftState":
        """Per-session drafting state with its own KV cache of `capacity` tokens (see `DraftState`
        for `window`)."""
        return DraftState(self, capacity, window)


def fingerprint(target: Transformer) -> str:
    """Short hash identifying a target model's weights (vocab size, dim, first embedding rows)."""
    rows = target.tok_embeddings(torch.arange(min(8, target.args.vocab_size), device=target.device))  # may be int8
    w = rows.detach().to(torch.float16).cpu().numpy().tobytes()
    h = hashlib.sha1(w + f"{target.args.vocab_size}/{target.args.dim}".encode()).hexdigest()
    return h[:16]


class DraftState:
    """A draft model's KV cache for one session, following the session's token sequence.

    `logits(context)` keeps the longest common prefix of what is cached and `context`, prefills
    the rest and returns the draft's logits [Vd] for the token after `context`. `sync(context)`
    does the prefill alone, so it can run when the session prefills an observation instead of
    on the decision's critical path (`Speculator.observe`).

    With a `window` (tokens; pruned sessions pass their KV budget) the draft attends only over the
    context's last `window` to 1.5 `window` tokens: when the context outgrows that, the oldest
    cached tokens are dropped so that `window` remain (a slide: their keys and values are moved,
    not recomputed), so drafting costs stay flat on endless streams while the target's own KV is
    pruned. Rotary attention depends on relative positions only, so for a one-layer draft (whose
    keys and values depend on their own token alone) the slide equals recomputing the window
    from position 0, which is what training sees (`tokenspeed.draft.train.context_view`); for
    deeper drafts it is StreamingLLM-style eviction. A full refill happens only after a rollback
    before the window, or when positions reach the end of the rotary table. Verification keeps
    the output exact whatever the draft sees.
    """

    def __init__(self, draft: DraftModel, capacity: int, window: int | None = None):
        self.draft = draft
        self.window = window
        self.device = draft.vocab.device
        self.cache: KVCache = draft.net.new_cache(capacity if window is None else min(capacity, window + window // 2 + 1))
        self.tokens = np.zeros(self.cache.capacity, dtype=np.int64)
        self.offset = 0  # context index of the token in cache slot 0
        self.anchor = 0  # context index of rotary position 0

    def sync(self, context: np.ndarray, logits: bool = False) -> torch.Tensor | None:
        """Make the cache hold `context` [N] int64 (its last `window`-1.5 `window` tokens with a
        window); with `logits`, return the draft logits [Vd] (fp32) for the token after it (its
        last token is then always recomputed). None when the context outgrew the draft's KV
        capacity (without a window; the draft then stays silent)."""
        if self.window is not None:
            start = max(0, len(context) - self.window)
            drop = start - self.offset
            if len(context) < self.offset or len(context) - self.anchor > len(self.draft.net.rope_cos):
                self.offset = self.anchor = start  # refill from rotary position 0
                self.cache.truncate(0)
            elif len(context) - self.offset > self.cache.capacity:  # slide: forget the `drop` oldest cached tokens
                n = self.cache.n
                self.tokens[:max(n - drop, 0)] = self.tokens[drop:n].copy()
                self.cache.drop_oldest(drop)
                self.offset = start
        context = context[self.offset:]
        if len(context) > self.cache.capacity or len(context) == 0:
            return None
        m = min(self.cache.n, len(context))
        diff = np.flatnonzero(self.tokens[:m] != context[:m])
        keep = int(diff[0]) if len(diff) else m
        if logits:
            keep = min(keep, len(context) - 1)  # recompute >= 1 token
        self.cache.truncate(keep)
        new = context[keep:]
        self.tokens[keep:keep + len(new)] = new
        out = None
        for i in range(0, len(new), 512):  # bounded prefill chunks
            chunk = to_device(new[i:i + 512].tolist(), self.device)
            start = keep + i + self.offset - self.anchor  # rotary position of the chunk's first token
            out = self.draft.net(chunk, start, self.cache, "last" if logits and i + 512 >= len(new) else "none")
        return out[0] if logits else None

    def logits(self, context: np.ndarray) -> torch.Tensor | None:
        """Draft logits [Vd] (fp32) after `context` [N] int64 (the session's full token sequence),
        or None when the context outgrew the draft's KV capacity."""
        return self.sync(context, logits=True)
