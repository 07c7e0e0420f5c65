"""Llama-family decoder with an explicit, pre-allocated KV cache (gpt-fast style).

Covers Llama 2/3/3.1 (incl. Llama-3.1 RoPE scaling), SmolLM2, Mistral, Qwen2 (QKV bias), Qwen3
(per-head RMSNorm of queries and keys before the rotation) and SmolLM3 (no rotation in every 4th
layer, "NoPE"): RMSNorm, rotary embeddings (Hugging Face "rotate half" layout), grouped-query
attention, SwiGLU, tied or untied embeddings. The numerics follow Hugging Face `transformers`' Llama
implementation so logits match it for the same weights.

Every projection is an `nn.Linear` that quantized linears replace (`tokenspeed.quant`; on the CPU the
embedding table too: `tok_embeddings` is an `nn.Embedding`, an `Int8Embedding` or a `BlockEmbedding`). On the
CPU, a forward of at most `FUSED_PREFILL_ROWS` new tokens (decode, draft verification, forced runs,
observations, prefill chunks) runs all layers in C++ calls of up to `FUSED_ROWS` tokens each when the
extension is built (`tokenspeed.kernels.cpu_decode`, same math); `use_fused = False` turns it off.
Attention that reports per-slot mass (relevance scoring) comes from `tokenspeed.kernels.attention`
(on CUDA, the Triton kernel for decode and verification); the norms and residual adds from
`tokenspeed.kernels.norm` (`use_triton_norm`: the fused Triton kernel on CUDA).

The KV cache holds `n` valid slots as a contiguous prefix `[0, n)` per layer; each forward writes
its T new tokens at slots `[n, n + T)` and attends over `[0, n + T)` (cached slots fully
visible, new tokens causal among themselves). Rotary positions are passed explicitly, so a
cache that drops slots keeps every token's original position: keys are stored already rotated
and never re-rotated, so a kept (or recalled) slot is bit-identical to the full cache's. This
differs from StreamingLLM (Xiao et al. 2023, sec. 3.2), which re-indexes positions within the
rolling cache so that distances never exceed the trained context; we keep original positions
(exact equality with the full cache); the rotary tables cover `max_seq_len` positions and the
rotations of later positions (a pruned session's history past it, where relative distances are
beyond what the model was trained on) are computed per forward (`rope_at`), so memory stays
flat however long a session runs. A cache subclass that sets `tracks_attention` (see `tokenspeed.kv`) receives each
layer's attention mass through `record_attention` and may reorganise its slots in `prepare`.
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .kernels.attention import attention_mass
from .kernels.cpu_decode import FUSED_PREFILL_ROWS, FUSED_ROWS, FusedDecode
from .kernels.norm import add_rms_norm, rms_norm

__all__ = ["ModelArgs", "KVCache", "Transformer", "rope_tables", "apply_rope"]


@dataclass
class ModelArgs:
    """Architecture of a Llama-family decoder.

    Attributes (all ints unless noted): dim (hidden size), n_layers, n_heads, n_kv_heads,
    head_dim, hidden_dim (SwiGLU width), vocab_size, norm_eps (float), rope_theta (float),
    rope_scaling (dict, Hugging Face `rope_scaling` for Llama 3.1 or None), max_seq_len,
    tie_embeddings (bool), qkv_bias (bool, Qwen2), qk_norm (bool, Qwen3: RMSNorm over each
    query and key head, weights [head_dim], before the rotation), no_rope_layers (tuple of layer
    indices whose queries and keys are not rotated, SmolLM3's NoPE layers).
    """

    dim: int = 576
    n_layers: int = 30
    n_heads: int = 9
    n_kv_heads: int = 3
    head_dim: int = 64
    hidden_dim: int = 1536
    vocab_size: int = 49152
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_seq_len: int = 8192
    tie_embeddings: bool = True
    qkv_bias: bool = False
    qk_norm: bool = False
    no_rope_layers: tuple[int, ...] = ()

    @classmethod
    def from_hf_config(cls, cfg: dict) -> "ModelArgs":
        """Build from a Hugging Face `config.json` dict (Llama, Mistral, Qwen2, Qwen3, SmolLM3 model
        types; SmolLM3's `no_rope_layers` holds 1 for a layer that rotates, 0 for a NoPE layer)."""
        n_heads = cfg["num_attention_heads"]
        # transformers >= 5 writes `rope_parameters` (with rope_theta inside); older `rope_scaling`.
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        scaling = rope if rope.get("rope_type", rope.get("type", "default")) != "default" else None
        return cls(
            dim=cfg["hidden_size"],
            n_layers=cfg["num_hidden_layers"],
            n_heads=n_heads,
            n_kv_heads=cfg.get("num_key_value_heads") or n_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // n_heads,
            hidden_dim=cfg["intermediate_size"],
            vocab_size=cfg["vocab_size"],
            norm_eps=cfg.get("rms_norm_eps", 1e-5),
            rope_theta=cfg.get("rope_theta", rope.get("rope_theta", 10000.0)),
            rope_scaling=scaling,
            max_seq_len=cfg.get("max_position_embeddings", 4096),
            tie_embeddings=cfg.get("tie_word_embeddings", False),
            qkv_bias=cfg.get("model_type") == "qwen2" or cfg.get("attention_bias", False),
            qk_norm=cfg.get("model_type") == "qwen3",
            no_rope_layers=tuple(i for i, rotates in enumerate(cfg.get("no_rope_layers") or ()) if not rotates),
        )


def _sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    mask: torch.Tensor | None) -> torch.Tensor:
    # q: [1, H, T, D], k/v: [1, Hkv, S, D] (an fp16 CPU cache is read as q's dtype), mask: [T, S] bool
    # (True = attend) or None (all)
    k, v = k.to(q.dtype), v.to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])


def rope_tables(args: ModelArgs, device=None, length: int | None = None,
                positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [length or max_seq_len, head_dim] (fp32) with Llama-3.1 scaling if configured;
    with `positions` ([T] int64), the rows of those positions only ([T, head_dim]).

    Source: RoFormer (Su et al., 2021); Llama 3.1 scaling as in Meta's reference
    `apply_scaling` / Hugging Face `_compute_llama3_parameters`.
    """
    d = args.head_dim
    if torch.device(device or torch.get_default_device()).type == "meta":
        # shapes only (arange on meta imports torch._dynamo: seconds)
        shape = (len(positions) if positions is not None else length or args.max_seq_len, d)
        return torch.empty(shape, device="meta"), torch.empty(shape, device="meta")
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64, device=device) / d))
    sc = args.rope_scaling or {}
    if sc.get("rope_type", sc.get("type")) == "llama3":
        factor, lo, hi = sc["factor"], sc.get("low_freq_factor", 1.0), sc.get("high_freq_factor", 4.0)
        old_ctx = sc.get("original_max_position_embeddings", 8192)
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_ctx / wavelen - lo) / (hi - lo)
        scaled = torch.where(wavelen > old_ctx / lo, inv_freq / factor, inv_freq)
        mid = (wavelen <= old_ctx / lo) & (wavelen >= old_ctx / hi)
        inv_freq = torch.where(mid, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)
    pos = (torch.arange(length or args.max_seq_len, dtype=torch.float64, device=device) if positions is None
           else positions.to(device=device, dtype=torch.float64))
    freqs = torch.outer(pos, inv_freq).float()
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [1, H, T, D] by cos/sin [T, D] fp32 ("rotate half" layout); result in x's dtype."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


class KVCache(nn.Module):
    """Pre-allocated keys and values for all layers: k, v [n_layers, 1, n_kv_heads, capacity, head_dim].

    `n` is the number of valid slots (a contiguous prefix); `pos` [capacity] int64 holds each
    slot's rotary position. Truncating (rollback, rejected draft tokens) only lowers `n`. The
    position of the next token is kept on the host (`next_position`), so no forward reads `pos`
    back from the device: forwards append tokens at consecutive positions (`advance`), and the
    slots `truncate` drops are the newest ones.

    The session-facing contract (`admit`, `trim`, `decision`, `snapshot`, `restore`,
    `take_metrics`, `segments`) is shared with the pruned `tokenspeed.kv.TieredKVCache`; here
    it keeps every token, so most of it does nothing.

    Attributes:
        segments: the session's `Segment`s in cache order (what each span of context holds).
    """

    tracks_attention = False  # True: forward calls record_attention(layer, q, mass, lse) per layer

    def __init__(self, args: ModelArgs, capacity: int, dtype=torch.float32, device=None):
        super().__init__()
        shape = (args.n_layers, 1, args.n_kv_heads, capacity, args.head_dim)
        # On the CPU no forward reads a slot before writing it (attention covers the valid prefix
        # only), so the pages are left to the first write instead of zeroed here (~0.4 s for the
        # default capacity); a CUDA graph attends over a fixed span under a mask, so there: zeros.
        alloc = torch.empty if torch.device(device or torch.get_default_device()).type == "cpu" else torch.zeros
        self.register_buffer("k", alloc(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", alloc(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("pos", torch.zeros(capacity, dtype=torch.long, device=device), persistent=False)
        self.capacity = capacity
        self.n = 0
        self._next = 0  # rotary position of the next appended token (host int, see next_position)
        self.segments: list = []

    def truncate(self, n: int) -> None:
        """Keep only the first n slots (n <= current length); the dropped newest slots held
        consecutive positions, so the next position goes back by their number."""
        if not 0 <= n <= self.n:
            raise ValueError(f"cannot truncate KV cache of {self.n} slots to {n}")
        self._next -= self.n - n
        self.n = n

    def advance(self, T: int, next_position: int) -> None:
        """Count the T slots [n, n + T) a forward has written, the newest at rotary position
        next_position - 1 (a host int from the forward's caller: nothing is read from the device)."""
        self.n += T
        self._next = next_position

    def drop_oldest(self, k: int) -> None:
        """Forget the k oldest slots (a sliding window): slots [k, n) move to [0, n - k) with their
        keys, values and positions; the next position is unchanged."""
        kept = max(self.n - k, 0)
        if kept:
            for buf in (self.k, self.v):
                buf[:, :, :, :kept] = buf[:, :, :, k:self.n].clone()
            self.pos[:kept] = self.pos[k:self.n].clone()
        self.n = kept

    def prepare(self, T: int) -> None:
        """Called by `Transformer.forward` before writing T new slots at [n, n + T).

        Raises:
            ValueError: no room for T more tokens.
        """
        if self.n + T > self.capacity:
            raise ValueError(f"KV cache full: {self.n} + {T} tokens > capacity {self.capacity}")

    def next_position(self) -> int:
        """Rotary position for the next appended token: the newest position + 1, 0 for a new cache
        (a host int: reading it does not synchronise with the device)."""
        return self._next

    def admit(self, n_context: int, n_new: int) -> None:
        """Check that a context of n_context tokens can take n_new more.

        Raises:
            ValueError: it would exceed the capacity ("context full").
        """
        if n_context + n_new > self.capacity:
            raise ValueError(f"context full: {n_context} + {n_new} tokens > KV capacity {self.capacity}")

    def trim(self) -> None:
        """Shrink to the cache's budget between decisions (every token is kept here)."""

    @contextmanager
    def decision(self):
        """Scope of one decision's forwards (nothing changes here)."""
        yield

    def snapshot(self) -> None:
        """State beyond the token count that `restore` needs (none here)."""
        return None

    def restore(self, n_tokens: int, snapshot=None, keep: int = 0) -> int:
        """Go back to the first n_tokens tokens (rollback), keeping up to `keep` of the tokens
        after them (as many as are cached); returns how many were kept."""
        kept = max(0, min(keep, self.n - n_tokens))
        self.truncate(n_tokens + kept)
        return kept

    def take_metrics(self) -> dict | None:
        """Tiering metrics since the last call (None: this cache does not tier)."""
        return None


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer: int = 0):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        q, kv = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
        self.q_size, self.kv_size = q, kv
        self.eps = args.norm_eps
        self.rotates = layer not in args.no_rope_layers
        self.wqkv = nn.Linear(args.dim, q + 2 * kv, bias=args.qkv_bias)
        self.wo = nn.Linear(q, args.dim, bias=False)
        if args.qk_norm:  # Qwen3: RMSNorm weights over each query / key head
            self.q_norm = nn.Parameter(torch.ones(args.head_dim))
            self.k_norm = nn.Parameter(torch.ones(args.head_dim))
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x, cos, sin, cache: KVCache, layer: int, start: int, mask, slots=None, span: int = 0):
        # x: [1, T, dim]; cos/sin: [T, D]; writes KV slots [start, start + T) and attends over [0, start + T);
        # with slots ([T] int64 device tensor, a CUDA graph's static input): writes KV at those slots and
        # attends over [0, span)
        T = x.shape[1]
        q, k, v = self.wqkv(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(1, T, self.n_heads, self.head_dim).transpose(1, 2)       # [1, H, T, D]
        k = k.view(1, T, self.n_kv_heads, self.head_dim).transpose(1, 2)    # [1, Hkv, T, D]
        v = v.view(1, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        if self.q_norm is not None:
            q, k = rms_norm(q, self.q_norm, self.eps), rms_norm(k, self.k_norm, self.eps)
        if self.rotates:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if slots is None:
            end = start + T
            cache.k[layer, :, :, start:end] = k
            cache.v[layer, :, :, start:end] = v
        else:
            end = span
            cache.k[layer, 0].index_copy_(1, slots, k[0].to(cache.k.dtype))  # (an fp16 CPU cache: rounded here)
            cache.v[layer, 0].index_copy_(1, slots, v[0].to(cache.v.dtype))
        if cache.tracks_attention:
            out, mass, lse = attention_mass(q, cache.k[layer, :, :, :end], cache.v[layer, :, :, :end], mask)
            cache.record_attention(layer, q, mass, lse)
        else:
            out = _sdpa_attention(q, cache.k[layer, :, :, :end], cache.v[layer, :, :, :end], mask)
        return self.wo(out.transpose(1, 2).reshape(1, T, -1))


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.hidden = args.hidden_dim
        self.w13 = nn.Linear(args.dim, 2 * args.hidden_dim, bias=False)  # gate and up, fused
        self.w2 = nn.Linear(args.hidden_dim, args.dim, bias=False)

    def forward(self, x):
        gate, up = self.w13(x).split([self.hidden, self.hidden], dim=-1)
        return self.w2(F.silu(gate) * up)


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, layer: int = 0):
        super().__init__()
        self.attention = Attention(args, layer)
        self.feed_forward = FeedForward(args)
        self.attention_norm = nn.Parameter(torch.ones(args.dim))
        self.ffn_norm = nn.Parameter(torch.ones(args.dim))


class Transformer(nn.Module):
    """The decoder. `forward` runs T new tokens against a `KVCache` and returns selected logits.

    Attributes:
        use_fused: run forwards of at most `FUSED_PREFILL_ROWS` tokens through the fused CPU decode step
            when it is available (default True; the Python path gives the same results).
        use_triton_norm: on CUDA, each residual add and the norm after it run as one Triton kernel
            (`tokenspeed.kernels.triton_norm`). Default False: `tokenspeed bench gpu` times both, and
            it stays off until a GPU measurement shows it helps.
    """

    use_fused = True
    use_triton_norm = False

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self._fused: FusedDecode | None | bool = False  # False: not built yet (see fused_decode)
        # Initialised here as nn.Embedding would (normal), except on the meta device: normal_ on a
        # meta tensor imports torch._dynamo (seconds of CPU at start-up) for a weight never read.
        emb = torch.empty(args.vocab_size, args.dim)
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim,
                                           _weight=emb if emb.is_meta else nn.init.normal_(emb))
        self.layers = nn.ModuleList(TransformerBlock(args, i) for i in range(args.n_layers))
        self.norm = nn.Parameter(torch.ones(args.dim))
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.tie_weights()
        cos, sin = rope_tables(args)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    @property
    def device(self) -> torch.device:
        """The device of the weights (and of every tensor a forward takes)."""
        return self.norm.device

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype (the norms' weights'; a new KV cache's is `kv_dtype`). The embedding
        table may be stored otherwise (`tokenspeed.quant.Int8Embedding`): read these, not its weight."""
        return self.norm.dtype

    def tie_weights(self) -> None:
        """Share the embedding matrix with the output projection when the model ties them: the float
        weight of an `nn.Linear` head, the int8 codes and group scales of an `Int8Embedding` with an
        `Int8Linear` head of the same groups (`Int8Linear.tied`), or a `BlockEmbedding`'s blocks with a
        `BlockLinear` head of the same format (`BlockLinear.tied`); any other quantized head keeps its own."""
        from .quant import BlockEmbedding, BlockLinear, Int8Embedding, Int8Linear

        out, emb = self.output, self.tok_embeddings
        if not self.args.tie_embeddings:
            return
        if isinstance(out, nn.Linear):
            out.weight = emb.weight
        elif (isinstance(out, BlockLinear) and isinstance(emb, BlockEmbedding) and out.FORMAT == emb.FORMAT
              and out.blocks.shape == emb.blocks.shape):
            out.blocks = emb.blocks
        elif (isinstance(out, Int8Linear) and isinstance(emb, Int8Embedding) and out.group == emb.GROUP
              and out.qweight.shape == emb.qweight.shape and out.scales.dtype == emb.scales.dtype):
            out.qweight, out.scales = emb.qweight, emb.scales

    def _apply(self, fn, recurse=True):
        # Keep rotary tables fp32 on any dtype cast, and rebuild them after `to_empty()` from meta.
        out = super()._apply(fn, recurse)
        cos, sin = rope_tables(self.args, device=self.rope_cos.device, length=self.rope_cos.shape[0])
        self.rope_cos, self.rope_sin = cos, sin
        self.tie_weights()
        self.invalidate_fused()
        return out

    def invalidate_fused(self) -> None:
        """Forget the fused decode step's weight lists (after moving, casting or quantizing)."""
        self._fused = False

    def fused_decode(self) -> FusedDecode | None:
        """The fused CPU decode step for the current weights, or None where it does not apply."""
        if self._fused is False:
            from .quant import fused_ext

            ext = fused_ext() if FusedDecode.supports(self) else None
            self._fused = FusedDecode(ext, self) if ext is not None else None
        return self._fused

    def rope_at(self, positions: torch.Tensor, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, head_dim] (fp32) of the rotary positions [T] (int64): rows of the tables, or
        computed for these positions when one is past them (beyond the trained context, see the
        module docstring; the tables never grow, so a session of any length keeps memory flat).
        `end` is one past the largest position, from the caller's host-side count (reading it from
        `positions` would synchronise with the device every forward)."""
        if end > self.rope_cos.shape[0]:
            return rope_tables(self.args, device=self.rope_cos.device, positions=positions)
        return self.rope_cos[positions], self.rope_sin[positions]

    @property
    def kv_dtype(self) -> torch.dtype:
        """The dtype of a new KV cache: float16 on the CPU where the fused step runs (`fused_decode`,
        whether or not `use_fused` is on: both paths share the cache), half the memory of fp32, as
        llama.cpp's f16 cache; keys and values are rounded once on write and attention reads them as
        fp32. Elsewhere (CUDA, bf16, no compiler) the activations' dtype."""
        return torch.float16 if self.fused_decode() is not None else self.dtype

    def new_cache(self, capacity: int | None = None, dtype=None) -> KVCache:
        """A KV cache for up to `capacity` tokens (default: the model's max_seq_len) of `dtype`
        (default: `kv_dtype`)."""
        return KVCache(self.args, capacity or self.args.max_seq_len, dtype or self.kv_dtype, self.device)

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, positions: int | torch.Tensor, cache: KVCache,
                logits_for: str | torch.Tensor = "last", head: bool = True) -> torch.Tensor:
        """Append T tokens to the cache and return logits.

        Args:
            tokens: [T] int64 token ids.
            positions: rotary positions of these tokens: an int p for p .. p + T - 1 (the decode
                path: no host read), or increasing [T] int64 (its maximum is read on the host, a
                synchronisation on an accelerator: reference and test paths).
            cache: the KV cache; slots [cache.n, cache.n + T) are written and cache.n advances by T.
            logits_for: "last" -> logits [1, vocab] of the last token; "all" -> [T, vocab];
                an int64 index tensor [K] -> [K, vocab] for those rows; "none" -> None (prefill).
            head: False -> the final normalised hidden states [K, dim] of those rows instead of
                logits (the caller projects only the vocabulary rows it needs).
        Returns:
            fp32 logits (or hidden states) as above.
        Raises:
            ValueError: the cache has no room for T more tokens.
        """
        T = tokens.shape[0]
        if isinstance(positions, torch.Tensor):
            end = int(positions.max()) + 1 if T else cache.next_position()
        else:
            end = int(positions) + T
            positions = torch.arange(end - T, end, dtype=torch.long, device=self.rope_cos.device)
        cache.prepare(T)
        start = cache.n
        cos, sin = self.rope_at(positions, end)
        cache.pos[start:start + T] = positions
        eps = self.args.norm_eps
        fused = (self.fused_decode() if self.use_fused and T <= FUSED_PREFILL_ROWS
                 and cache.k.dtype in (torch.float16, torch.float32) else None)
        if fused is not None:  # blocks of FUSED_ROWS new tokens, each attending over the ones before it
            x = self.tok_embeddings(tokens)  # [T, dim]
            h = torch.cat([fused(x[i:i + FUSED_ROWS], cos[i:i + FUSED_ROWS], sin[i:i + FUSED_ROWS], cache, start + i)
                           for i in range(0, T, FUSED_ROWS)]).unsqueeze(0)
        else:
            mask = None
            if T > 1:  # cached slots visible, causal among the new tokens
                mask = torch.ones(T, start + T, dtype=torch.bool, device=tokens.device)
                mask[:, start:] = torch.ones(T, T, dtype=torch.bool, device=tokens.device).tril()
            h = self.blocks(self.tok_embeddings(tokens).unsqueeze(0), cos, sin, cache, start, mask)
        cache.advance(T, end)
        if isinstance(logits_for, str):
            if logits_for == "none":
                return None
            h = h[0, -1:] if logits_for == "last" else h[0]
        else:
            h = h[0, logits_for]
        h = rms_norm(h, self.norm, eps)
        return self.output(h).float() if head else h

    def blocks(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache, start: int,
               mask: torch.Tensor | None, slots: torch.Tensor | None = None, span: int = 0) -> torch.Tensor:
        """The decoder layers in Python: h [1, T, dim] embeddings -> residual stream [1, T, dim]
        (before the final norm). KV goes to cache slots [start, start + T), attention over
        [0, start + T) under mask [T, start + T] bool (None: all); with `slots` ([T] int64 on the
        device) and `span`, to those slots and over [0, span) under mask [T, span] (the fixed shapes
        of a CUDA graph, `tokenspeed.device.DecodeGraphs`)."""
        eps, fuse = self.args.norm_eps, self.use_triton_norm
        h, x = add_rms_norm(h, None, self.layers[0].attention_norm, eps, fuse)
        for i, layer in enumerate(self.layers):
            h, x = add_rms_norm(h, layer.attention(x, cos, sin, cache, i, start, mask, slots, span),
                                layer.ffn_norm, eps, fuse)
            delta = layer.feed_forward(x)
            if i + 1 < len(self.layers):  # the residual add and the next layer's norm, in one pass
                h, x = add_rms_norm(h, delta, self.layers[i + 1].attention_norm, eps, fuse)
            else:
                h = h + delta
        return h

    def load_hf_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load Hugging Face Llama/Qwen2/Qwen3 names into this module (fusing QKV and gate/up).

        Raises:
            KeyError: a required tensor is missing; ValueError: a shape does not match.
        """
        def take(name):
            if name not in state:
                raise KeyError(f"checkpoint lacks tensor {name}")
            return state[name]

        own = {}
        own["tok_embeddings.weight"] = take("model.embed_tokens.weight")
        own["norm"] = take("model.norm.weight")
        if not self.args.tie_embeddings:
            own["output.weight"] = take("lm_head.weight")
        for i in range(self.args.n_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            own[f"layers.{i}.attention.wqkv.weight"] = torch.cat(
                [take(a + "q_proj.weight"), take(a + "k_proj.weight"), take(a + "v_proj.weight")])
            if self.args.qkv_bias:
                own[f"layers.{i}.attention.wqkv.bias"] = torch.cat(
                    [take(a + "q_proj.bias"), take(a + "k_proj.bias"), take(a + "v_proj.bias")])
            own[f"layers.{i}.attention.wo.weight"] = take(a + "o_proj.weight")
            if self.args.qk_norm:
                own[f"layers.{i}.attention.q_norm"] = take(a + "q_norm.weight")
                own[f"layers.{i}.attention.k_norm"] = take(a + "k_norm.weight")
            own[f"layers.{i}.feed_forward.w13.weight"] = torch.cat(
                [take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")])
            own[f"layers.{i}.feed_forward.w2.weight"] = take(p + "mlp.down_proj.weight")
            own[f"layers.{i}.attention_norm"] = take(p + "input_layernorm.weight")
            own[f"layers.{i}.ffn_norm"] = take(p + "post_attention_layernorm.weight")
        params = dict(self.named_parameters())
        for name, value in own.items():
            if params[name].shape != value.shape:
                raise ValueError(f"{name}: checkpoint shape {tuple(value.shape)} != model {tuple(params[name].shape)}")
            with torch.no_grad():
                params[name].copy_(value)
