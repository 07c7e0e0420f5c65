"""Where the engine's tensors live: the device and dtype settings, host-to-device copies, the
decode step as a CUDA graph (`DecodeGraphs`), and the worker thread of a pipelined CPU engine (`host_worker`).

Everything here runs on the CPU too: the graph runner then runs its step eagerly through the
same buffers, so the CPU tests check its bookkeeping.
"""
from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

import torch

__all__ = ["DeviceError", "DTYPES", "resolve_device", "resolve_dtype", "to_device", "resolve_pipeline", "host_worker", "DecodeGraphs"]

log = logging.getLogger(__name__)


class DeviceError(ValueError):
    """A device or dtype setting is malformed, or names a device this machine does not have
    (e.g. "cuda" without a CUDA GPU)."""


# dtype names the CLI and the ROS nodes accept ("auto": bf16 on CUDA, fp32 elsewhere)
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def resolve_device(device: "str | torch.device | None" = "auto") -> torch.device:
    """The torch device for a device setting: "auto" (or None) -> "cuda" when
    `torch.cuda.is_available()`, else "cpu"; "cpu"; "cuda" or "cuda:N".

    Raises:
        DeviceError: not one of those, or CUDA (device N) is not available here.
    """
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise DeviceError(f"device must be auto, cpu, cuda or cuda:N, got {device!r}") from exc
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda":
        raise DeviceError(f"device must be auto, cpu, cuda or cuda:N, got {device!r}")
    if not torch.cuda.is_available():
        raise DeviceError(f"device {device!r} asked for, but CUDA is not available here (torch "
                          f"{torch.__version__}, CUDA build: {torch.version.cuda or 'no'}); use --device cpu or auto")
    if dev.index is not None and dev.index >= torch.cuda.device_count():
        raise DeviceError(f"device {device!r} asked for, but this machine has {torch.cuda.device_count()} "
                          "CUDA device(s)")
    return dev


def resolve_dtype(dtype: "str | torch.dtype | None", device: torch.device) -> torch.dtype:
    """The weight and KV-cache dtype for a dtype setting on `device`: "auto" (or None) -> bfloat16
    on CUDA, float32 elsewhere; a `DTYPES` name or a torch floating dtype as given.

    Raises:
        DeviceError: an unknown name or a non-floating dtype.
    """
    if dtype is None or dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
        return dtype
    if isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    raise DeviceError(f"dtype must be auto or one of {sorted(DTYPES)}, got {dtype!r}")


def to_device(values: "list[int] | torch.Tensor", device: torch.device) -> torch.Tensor:
    """`values` on `device`: a list of ints as [N] int64, or a host tensor as it is (on CUDA through
    pinned memory, copied non-blocking: the host does not wait for the device)."""
    t = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=torch.long, device="cpu")
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t.to(device)


def resolve_pipeline(device: torch.device, pipeline: bool | None = None) -> bool:
    """Whether decode steps draft the next chain while their forward runs (`tokenspeed.decode`).

    None (auto): on CUDA, where the forward is queued kernels and the host works beside them on
    its own thread; off on the CPU, where the host's work must run on a worker thread
    (`host_worker`) and, measured on a 2-core VM, the forward then ran slower by more than the
    overlap saved (README, GPU, "Pipelining"). True or False: as given.
    """
    return device.type != "cpu" if pipeline is None else bool(pipeline)


def host_worker(device: torch.device, pipeline: bool) -> ThreadPoolExecutor | None:
    """The one-thread executor on which a pipelined CPU engine's host work (grammar masks, drafting
    the next step) runs while the caller's thread runs the decode forward
    (`tokenspeed.decode.Target.forward_beside`), or None (not pipelined, or off the CPU: there the
    host works beside the queued kernels on the caller's thread)."""
    return ThreadPoolExecutor(1, thread_name_prefix="tokenspeed-host") if pipeline and device.type == "cpu" else None


class _Width:
    """Static buffers of one forward width w: inputs [3, w] int64 on the device (token ids,
    rotary positions, cache slots) and their host staging (pinned on CUDA); per attention span,
    the captured graph (or None) and its output hidden states [w, dim]."""

    def __init__(self, w: int, device: torch.device):
        self.inputs = torch.zeros((3, w), dtype=torch.long, device=device)
        self.host = torch.zeros((3, w), dtype=torch.long, device="cpu", pin_memory=device.type == "cuda")
        self.copied = None  # CUDA: an event after the last copy out of `host` (rewrite it only once done)
        self.graphs: dict[int, tuple] = {}  # span -> (CUDAGraph or None, output [w, dim])


class DecodeGraphs:
    """The decode step as CUDA graphs for one session's KV cache: one graph per forward width
    (1..`max_width` rows: a decode step, or a verification of the fed tokens and a draft chain)
    and attention span, captured the first time it runs and replayed after.

    The graph's forward (`static_forward`) has fixed shapes: token ids, rotary positions and cache
    slots come from static device buffers, K/V are written at the slots, and attention runs over
    the cache's first `span` slots with a mask from the slots (gpt-fast's static KV cache); the
    span is the power of two (>= `MIN_SPAN`, <= the capacity) that holds the context, so a step's
    cost follows its context, not the capacity. A step copies its inputs into the width's
    buffers, replays, and advances the cache's slot count on the host.
    It applies to a `tokenspeed.model.KVCache` (not to caches that track attention for pruning),
    positions inside the rotary tables and widths up to `max_width`; the caller runs the model's
    own forward for the rest. With `capture` off (the CPU) the same step runs eagerly through the
    same buffers. A capture that fails logs one line and leaves the runner eager.

    Args:
        model: the `tokenspeed.model.Transformer`.
        cache: the session's `tokenspeed.model.KVCache` (its tensors must never be reallocated:
            the graphs hold their addresses).
        max_width: the widest forward run here (tokens).
        capture: capture CUDA graphs (default: when the model is on CUDA).

    Attributes:
        widths: width -> its `_Width` buffers, for the widths run so far.
        eager: True once a capture failed (everything then runs eagerly).
    """

    MIN_SPAN = 256

    def __init__(self, model, cache, max_width: int = 32, capture: bool | None = None):
        self.model, self.cache, self.max_width = model, cache, max_width
        self.device = model.device
        self.capture = self.device.type == "cuda" if capture is None else capture
        self.widths: dict[int, _Width] = {}
        self.eager = False
        self._pool = None
        self._slots = torch.arange(cache.capacity, device=self.device)  # [capacity] slot indices
        if cache.k.device.type == "cpu":
            # the static step attends over slots past the valid ones under a mask, so they must hold
            # finite values: a CPU KVCache leaves its unwritten slots unset (uninitialised memory)
            cache.k[:, :, :, cache.n:].zero_()
            cache.v[:, :, :, cache.n:].zero_()

    def applies(self, n_tokens: int, pos0: int) -> bool:
        """Whether a forward of n_tokens new tokens from rotary position pos0 runs here."""
        return (1 <= n_tokens <= self.max_width and not self.cache.tracks_attention
                and self.cache.n + n_tokens <= self.cache.capacity and pos0 + n_tokens <= len(self.model.rope_cos))

    def run(self, ids: list[int], pos0: int) -> torch.Tensor:
        """Append `ids` at rotary positions pos0.. and cache slots n.. ; returns the final normalised
        hidden states [len(ids), dim] (a static buffer: read or project it before the next run)."""
        w, n = len(ids), self.cache.n
        span = min(max(self.MIN_SPAN, 1 << (n + w - 1).bit_length()), self.cache.capacity)
        buf = self.widths.get(w)
        if buf is None:
            buf = self.widths[w] = _Width(w, self.device)
        if buf.copied is not None:
            buf.copied.synchronize()  # two forwards of this width without a read between (prefill)
        buf.host[0] = torch.tensor(ids, dtype=torch.long, device="cpu")
        buf.host[1] = torch.arange(pos0, pos0 + w, device="cpu")
        buf.host[2] = torch.arange(n, n + w, device="cpu")
        buf.inputs.copy_(buf.host, non_blocking=True)
        if self.device.type == "cuda":
            buf.copied = torch.cuda.Event()
            buf.copied.record()
        graph, out = buf.graphs.get(span, (None, None))
        if graph is None and out is None and self.capture and not self.eager:
            graph, out = buf.graphs[span] = self._capture(buf, span)
        if graph is not None:
            graph.replay()
        else:
            out = self.static_forward(buf.inputs, span)
        self.cache.advance(w, pos0 + w)
        return out

    def _capture(self, buf: _Width, span: int) -> tuple:
        """Capture the (width, span) graph after two warm-up runs on a side stream (as CUDA graphs
        need): (graph, its output); on failure log one line, run eagerly from now on: (None, None)."""
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):  # writes the K/V of this very step, which the replay writes again
                    self.static_forward(buf.inputs, span)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                out = self.static_forward(buf.inputs, span)
            self._pool = graph.pool()
            return graph, out
        except Exception as exc:  # any capture failure: eager, with one log line
            self.eager = True
            log.warning("CUDA graph capture of a %d-token decode step failed (%s: %s): decode steps run eagerly",
                        buf.inputs.shape[1], type(exc).__name__, exc)
            return None, None

    @torch.no_grad()
    def static_forward(self, inputs: torch.Tensor, span: int) -> torch.Tensor:
        """The model's forward with fixed shapes: inputs [3, w] int64 (token ids, rotary
        positions, cache slots < span) -> final normalised hidden states [w, dim]. Writes K/V and
        positions at the slots; row i attends over the slots j <= slots[i]."""
        from .kernels.norm import rms_norm

        m, cache = self.model, self.cache
        tokens, positions, slots = inputs
        cos, sin = m.rope_cos[positions], m.rope_sin[positions]
        mask = self._slots[:span].unsqueeze(0) <= slots.unsqueeze(1)  # [w, span]
        cache.pos.index_copy_(0, slots, positions)
        h = m.blocks(m.tok_embeddings(tokens).unsqueeze(0), cos, sin, cache, 0, mask, slots, span)
        return rms_norm(h[0], m.norm, m.args.norm_eps)
