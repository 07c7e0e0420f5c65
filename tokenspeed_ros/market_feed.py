"""Parsing and validation of a cryptofeed-style market-data stream, one state per symbol.

Wire convention (cryptofeed's ZeroMQ backend): a PUB socket sends either one frame
``b"{EXCHANGE}-{channel}-{SYMBOL} {json}"`` or two frames ``[topic, json]``. Payloads:

- ``trades``: ``{"exchange", "symbol", "side": "buy"|"sell", "amount", "price", "id",
  "timestamp", "receipt_timestamp"}``
- ``book`` snapshot: ``{"exchange", "symbol", "book": {"bid": {price: size}, "ask": {...}},
  "timestamp", "receipt_timestamp", "sequence_number"?}``
- ``book`` delta: ``{..., "delta": {"bid": [[price, size], ...], "ask": [...]}}``; size is the
  new total at that level, 0 removes it.
- ``ticker``: ``{"exchange", "symbol", "bid", "ask", "timestamp", "receipt_timestamp"}``

Timestamps are float seconds since the Unix epoch. Every value is checked (finite, bounded,
timestamps not ahead of the local clock) before it touches the book, the trades or the feed
time. Everything malformed or implausible is counted in a :class:`collections.Counter` under the
keys of :data:`BAD_INPUT_KINDS` and dropped; nothing raises past :meth:`MarketFeed.handle` (an
unexpected exception is counted as "internal_error", its record dropped).
"""
from __future__ import annotations

import json
import math
import statistics
import time
from collections import Counter, deque
from dataclasses import dataclass, field

from tokenspeed_ros.order_book import SIDES, L2Book, imbalance

CHANNELS = ("trades", "book", "ticker")

#: Counter keys for input the feed refused (each record counted once, under one kind).
BAD_INPUT_KINDS = (
    "malformed",        # not a topic + JSON object, bad fields, wrong types
    "unknown_channel",  # a channel other than CHANNELS
    "seq_gap",          # book sequence jumped forward: book dropped until the next snapshot
    "out_of_order",     # book sequence or trade timestamp went backwards: update ignored
    "crossed",          # a book left bid >= ask (once per crossed episode), or a crossed ticker
    "bad_price",        # price <= 0, NaN or infinite
    "absurd_price",     # price outside the band around the reference price
    "bad_size",         # size < 0 (or 0 in a snapshot/trade), NaN or infinite
    "absurd_size",      # size above max_size
    "unsynced",         # delta for a book waiting for its snapshot
    "bad_timestamp",    # timestamp NaN, infinite, negative or ahead of the local clock
    "bad_sequence",     # sequence number negative or not below 2**63
    "too_large",        # message above max_message_bytes, or JSON nested too deep to parse
    "book_full",        # a new level on a side that already holds max_levels levels
    "too_many_symbols", # a record of a new (exchange, symbol) while max_symbols are known
)

#: Counter key for a record that raised an unexpected exception (a bug): counted, dropped.
INTERNAL_ERROR = "internal_error"


@dataclass(frozen=True)
class FeedLimits:
    """Plausibility limits for one feed.

    Attributes:
        price_band: a price is absurd when |price / reference - 1| exceeds this (0.25 = 25%).
        max_size: a level or trade size above this (base units, e.g. BTC) is absurd.
        max_crossed_msgs: a book crossed for this many consecutive updates is dropped and
            resynced from the next snapshot.
        trade_window: trades kept per symbol (bounded deque).
        vol_window: mid log-returns kept per symbol for the volatility estimate.
        max_future_s: a timestamp more than this ahead of the local clock (s) is refused, so
            one record stamped in the future cannot freeze feed time.
        max_message_bytes: a ZeroMQ message above this size (all frames, bytes) is refused
            before parsing.
        max_levels: price levels kept per book side; a new level beyond it is refused.
        max_symbols: (exchange, symbol) pairs kept; a record of another one is refused.
    """

    price_band: float = 0.25
    max_size: float = 1000.0
    max_crossed_msgs: int = 100
    trade_window: int = 200
    vol_window: int = 50
    max_future_s: float = 10.0
    max_message_bytes: int = 1 << 20
    max_levels: int = 10_000
    max_symbols: int = 64


@dataclass
class Trade:
    """One trade: timestamp (s since epoch), side ("buy"/"sell", taker side), price, amount."""

    timestamp: float
    side: str
    price: float
    amount: float


@dataclass
class SymbolState:
    """Everything the bridge knows about one (exchange, symbol)."""

    exchange: str
    symbol: str
    limits: FeedLimits
    book: L2Book = field(default_factory=L2Book)
    trades: deque = field(init=False)
    returns: deque = field(init=False)
    last_mid: float | None = None
    last_trade: Trade | None = None
    ticker: tuple[float, float] | None = None
    last_timestamp: float = 0.0     # exchange timestamp of the latest accepted update (s)
    crossed_msgs: int = 0           # consecutive book updates that left the book crossed
    needs_resync: bool = False      # the book was dropped after a problem (gap, crossing)

    def __post_init__(self) -> None:
        self.trades = deque(maxlen=self.limits.trade_window)
        self.returns = deque(maxlen=self.limits.vol_window)

    def reference_price(self) -> float | None:
        """Price that others are checked against: book mid, else last trade, else ticker mid."""
        mid = self.book.mid() if self.book.synced else None
        if mid is not None:
            return mid
        if self.last_trade is not None:
            return self.last_trade.price
        if self.ticker is not None and self.ticker[0] < self.ticker[1]:
            return 0.5 * (self.ticker[0] + self.ticker[1])
        return None

    def features(self, recent: int = 5) -> dict | None:
        """Compact market state, or None while the book is unsynced, one-sided or crossed.

        Also records the mid for the volatility estimate (one log-return per mid change).

        Returns a dict: mid, bid, ask, spread (price units), spread_bps, imbalance ([-1, 1]),
        volatility_bps (stdev of recent mid log-returns, basis points), last_trade_price,
        trades (the `recent` latest as [side, price, amount]), timestamp (s since epoch).
        """
        top = self.book.top() if self.book.synced else None
        if top is None or top[0] >= top[2]:
            return None
        bid, bid_size, ask, ask_size = top
        mid = 0.5 * (bid + ask)
        if self.last_mid is not None and mid != self.last_mid:
            self.returns.append(math.log(mid / self.last_mid))
        self.last_mid = mid
        vol = statistics.pstdev(self.returns) * 1e4 if len(self.returns) >= 2 else 0.0
        return {
            "exchange": self.exchange, "symbol": self.symbol, "timestamp": self.last_timestamp,
            "bid": bid, "ask": ask, "mid": mid, "spread": ask - bid,
            "spread_bps": (ask - bid) / mid * 1e4, "imbalance": imbalance(bid_size, ask_size),
            "volatility_bps": vol,
            "last_trade_price": self.last_trade.price if self.last_trade else 0.0,
            "trades": [[t.side, t.price, t.amount] for t in list(self.trades)[-recent:]],
        }


class FeedError(ValueError):
    """One record refused; `kind` is one of BAD_INPUT_KINDS."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind = kind


def split_message(frames: list[bytes]) -> tuple[str, str, str, bytes]:
    """Split one ZeroMQ message into (exchange, channel, symbol, json_bytes).

    Accepts the single-frame form ``b"EX-channel-SYM {json}"`` and the two-frame form
    ``[b"EX-channel-SYM", b"{json}"]``. The symbol may itself contain dashes (BTC-USD).

    Raises:
        FeedError("malformed"): any other shape.
    """
    if len(frames) == 1:
        topic, sep, body = frames[0].partition(b" ")
        if not sep:
            raise FeedError("malformed", "single frame without a space after the topic")
    elif len(frames) == 2:
        topic, body = frames
    else:
        raise FeedError("malformed", f"{len(frames)} frames")
    parts = topic.decode("utf-8", "replace").split("-", 2)
    if len(parts) != 3 or not all(parts):
        raise FeedError("malformed", f"topic {topic[:60]!r} is not EXCHANGE-channel-SYMBOL")
    return parts[0], parts[1], parts[2], body


def _number(value, what: str) -> float:
    """A JSON number or numeric string as a float (possibly NaN/inf: callers check the range)."""
    if type(value) is float:  # the common case, first
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise FeedError("malformed", f"{what} is {type(value).__name__}, not a number")
    try:
        return float(value)
    except ValueError:
        raise FeedError("malformed", f"{what}={str(value)[:40]!r} is not a number") from None
    except OverflowError:  # an integer too large for a float
        return math.inf


class MarketFeed:
    """Applies feed messages to per-symbol state and counts what it refuses.

    Attributes:
        symbols: {(exchange, symbol): SymbolState}.
        counters: Counter of accepted records ("trades", "book_snapshots", "book_deltas",
            "tickers", "resyncs") and refused ones (BAD_INPUT_KINDS).
    """

    def __init__(self, limits: FeedLimits | None = None, clock=time.time) -> None:
        """Args: limits: plausibility limits; clock: the local clock, () -> s since the epoch."""
        self.limits = limits or FeedLimits()
        self.clock = clock
        self.symbols: dict[tuple[str, str], SymbolState] = {}
        self.counters: Counter = Counter()
        self.last_internal_error = ""   # repr of the latest unexpected exception, for status

    def handle(self, frames: list[bytes]) -> SymbolState | None:
        """Apply one ZeroMQ message; returns the symbol state it changed, or None if refused.

        Never raises: refused records are counted under their BAD_INPUT_KINDS kind, and an
        unexpected exception under INTERNAL_ERROR (its repr kept in `last_internal_error`).
        """
        try:
            return self._handle(frames)
        except FeedError as err:
            self.counters[err.kind] += 1
        except Exception as err:  # noqa: BLE001 - one bad record must not stop the feed
            self.counters[INTERNAL_ERROR] += 1
            self.last_internal_error = repr(err)[:200]
        return None

    def _handle(self, frames: list[bytes]) -> SymbolState | None:
        size = sum(len(f) for f in frames)
        if size > self.limits.max_message_bytes:
            raise FeedError("too_large", f"{size} bytes > {self.limits.max_message_bytes}")
        exchange, channel, symbol, body = split_message(frames)
        if channel not in CHANNELS:
            raise FeedError("unknown_channel", channel[:40])
        try:
            msg = json.loads(body)
        except (ValueError, UnicodeDecodeError) as err:
            raise FeedError("malformed", f"JSON: {err}") from None
        except RecursionError:
            raise FeedError("too_large", "JSON nested too deep") from None
        if not isinstance(msg, dict):
            raise FeedError("malformed", "payload is not a JSON object")
        timestamp = self._timestamp(msg.get("timestamp"))
        key = (exchange, symbol)
        state = self.symbols.get(key)
        if state is None:
            if len(self.symbols) >= self.limits.max_symbols:
                raise FeedError("too_many_symbols", f"{exchange}-{symbol}"[:80])
            state = self.symbols[key] = SymbolState(exchange, symbol, self.limits)
        if channel == "trades":
            self._trade(state, msg, timestamp)
        elif channel == "ticker":
            self._ticker(state, msg)
        elif "book" in msg:
            self._snapshot(state, msg)
        elif "delta" in msg:
            self._delta(state, msg)
        else:
            raise FeedError("malformed", "book message with neither 'book' nor 'delta'")
        state.last_timestamp = max(state.last_timestamp, timestamp)
        return state

    # -- validation -----------------------------------------------------------------------
    def _timestamp(self, value) -> float:
        """The record's timestamp (s since the epoch): finite, >= 0, at most max_future_s ahead."""
        t = _number(value, "timestamp")
        if not math.isfinite(t) or t < 0.0:
            raise FeedError("bad_timestamp", f"timestamp {t}")
        ahead = t - self.clock()
        if ahead > self.limits.max_future_s:
            raise FeedError("bad_timestamp", f"timestamp {ahead:.1f} s ahead of the local clock")
        return t

    def _check(self, price: float, size: float, reference: float | None, *,
               zero_size_ok: bool) -> str | None:
        """Kind of problem with one (price, size), or None when plausible."""
        if not math.isfinite(price) or price <= 0.0:
            return "bad_price"
        if not math.isfinite(size) or size < 0.0 or (size == 0.0 and not zero_size_ok):
            return "bad_size"
        if size > self.limits.max_size:
            return "absurd_size"
        if reference is not None and abs(price / reference - 1.0) > self.limits.price_band:
            return "absurd_price"
        return None

    def _levels(self, side_levels, what: str) -> list[tuple[float, float]]:
        if isinstance(side_levels, dict):
            items = side_levels.items()
        elif isinstance(side_levels, list):
            items = side_levels
        else:
            raise FeedError("malformed", f"{what} is {type(side_levels).__name__}")
        out = []
        for item in items:
            if not isinstance(item, (list, tuple)) or len(item) != 2:
                raise FeedError("malformed", f"{what} entry {item!r} is not [price, size]")
            out.append((_number(item[0], "price"), _number(item[1], "size")))
        return out

    def _apply_levels(self, state: SymbolState, levels: dict[str, list], *,
                      reference: float | None, snapshot: bool) -> None:
        for side in SIDES:
            for price, size in levels[side]:
                problem = self._check(price, size, reference, zero_size_ok=not snapshot)
                if problem is None and price not in state.book.levels[side] and size > 0.0 \
                        and len(state.book.levels[side]) >= self.limits.max_levels:
                    problem = "book_full"
                if problem is not None:
                    self.counters[problem] += 1
                    continue
                state.book.set_level(side, price, size)

    def _book_sides(self, raw, what: str) -> dict[str, list]:
        if not isinstance(raw, dict):
            raise FeedError("malformed", f"{what} is not an object")
        # Parse both sides before touching the book, so a malformed message changes nothing.
        return {side: self._levels(raw.get(side, []), f"{what}.{side}") for side in SIDES}

    @staticmethod
    def _sequence(msg: dict) -> int | None:
        seq = msg.get("sequence_number")
        if seq is None:
            return None
        if isinstance(seq, bool) or not isinstance(seq, int):
            raise FeedError("malformed", f"sequence_number={str(seq)[:40]!r}")
        if not 0 <= seq < 1 << 63:
            raise FeedError("bad_sequence", f"sequence_number {str(seq)[:40]}")
        return seq

    # -- channels -------------------------------------------------------------------------
    def _snapshot(self, state: SymbolState, msg: dict) -> None:
        levels = self._book_sides(msg["book"], "book")
        seq = self._sequence(msg)
        reference = state.reference_price()
        if reference is None:  # first snapshot: the median level price is robust to outliers
            prices = [p for side in SIDES for p, _ in levels[side] if p > 0 and math.isfinite(p)]
            reference = statistics.median(prices) if prices else None
        book = state.book
        book.clear()
        self._apply_levels(state, levels, reference=reference, snapshot=True)
        book.sequence, book.synced = seq, True
        state.crossed_msgs = 0
        if state.needs_resync:
            self.counters["resyncs"] += 1
            state.needs_resync = False
        self.counters["book_snapshots"] += 1
        self._after_book_update(state)

    def _delta(self, state: SymbolState, msg: dict) -> None:
        levels = self._book_sides(msg["delta"], "delta")
        seq = self._sequence(msg)
        book = state.book
        if not book.synced:
            raise FeedError("unsynced", f"{state.symbol} delta before a snapshot")
        if seq is not None and book.sequence is not None:
            if seq <= book.sequence:
                raise FeedError("out_of_order", f"sequence {seq} after {book.sequence}")
            if seq != book.sequence + 1:
                self._drop_book(state)
                raise FeedError("seq_gap", f"sequence {book.sequence} -> {seq}")
        self._apply_levels(state, levels, reference=state.reference_price(), snapshot=False)
        book.sequence = seq
        self.counters["book_deltas"] += 1
        self._after_book_update(state)

    def _after_book_update(self, state: SymbolState) -> None:
        if not state.book.crossed():
            state.crossed_msgs = 0
            return
        if state.crossed_msgs == 0:
            self.counters["crossed"] += 1
        state.crossed_msgs += 1
        if state.crossed_msgs >= self.limits.max_crossed_msgs:
            self._drop_book(state)

    def _drop_book(self, state: SymbolState) -> None:
        state.book.clear()
        state.crossed_msgs = 0
        state.needs_resync = True

    def _trade(self, state: SymbolState, msg: dict, timestamp: float) -> None:
        side = msg.get("side")
        if side not in ("buy", "sell"):
            raise FeedError("malformed", f"trade side {side!r}")
        price = _number(msg.get("price"), "price")
        amount = _number(msg.get("amount"), "amount")
        problem = self._check(price, amount, state.reference_price(), zero_size_ok=False)
        if problem is not None:
            raise FeedError(problem, f"trade {price} x {amount}")
        if state.last_trade is not None and timestamp < state.last_trade.timestamp:
            raise FeedError("out_of_order", f"trade at {timestamp} after {state.last_trade.timestamp}")
        state.last_trade = Trade(timestamp, side, price, amount)
        state.trades.append(state.last_trade)
        self.counters["trades"] += 1

    def _ticker(self, state: SymbolState, msg: dict) -> None:
        bid = _number(msg.get("bid"), "bid")
        ask = _number(msg.get("ask"), "ask")
        reference = state.reference_price()
        for price in (bid, ask):
            problem = self._check(price, 1.0, reference, zero_size_ok=False)
            if problem is not None:
                raise FeedError(problem, f"ticker {bid}/{ask}")
        if bid >= ask:
            raise FeedError("crossed", f"ticker bid {bid} >= ask {ask}")
        state.ticker = (bid, ask)
        self.counters["tickers"] += 1

