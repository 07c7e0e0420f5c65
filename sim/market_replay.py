"""Market-feed replay over ZeroMQ in the cryptofeed convention.

Two sources of :class:`FeedMessage` streams:

- :func:`bitstamp_messages`: the real Bitstamp BTC/USD order-by-order capture (see
  `tokenspeed_sim.market_data`), turned into what an L2 feed publishes: one `book` snapshot,
  then one `book` delta per order event (the touched price levels with their new totals, in
  order, with a `sequence_number`), `trades` at their exchange times, a full snapshot every
  `snapshot_interval` deltas (cryptofeed's BookZMQ default: 1000) and a `ticker` (the replay
  book's best bid/ask) every `ticker_interval_s` of feed time. The capture's oddities go out as
  they are: price-0 and 999999999 market orders, absurd resting prices, crossed books.
- :func:`synthetic_messages`: a seeded random walk for tests that need exact control, with
  optional injected glitches whose expected counts are returned.

:class:`FeedPublisher` sends a stream on an XPUB socket (wire-compatible with PUB; it sees
subscriptions, so it can wait for the subscriber before the first message) at real or
accelerated speed. Following cryptofeed's backend, the publisher connects and the receiver
binds by default. Each payload gets `timestamp` = the message's feed time rebased onto the
wall clock at this speed, and `receipt_timestamp` = the wall time it was sent (both seconds
since the epoch), so a live consumer sees fresh ticks.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Iterable, Iterator

import zmq

from tokenspeed_sim.market_data import BitstampCapture, MarketDataUnavailable, load_bitstamp_capture

@dataclass(frozen=True)
class FeedMessage:
    """One feed message before it goes on the wire.

    Attributes:
        t: feed time, seconds (capture exchange time or synthetic clock); sets the pacing.
        topic: "EXCHANGE-channel-SYMBOL".
        payload: dict (JSON-encoded at send, with timestamps filled in) or bytes sent verbatim
            (for deliberately malformed records).
    """

    t: float
    topic: str
    payload: dict | bytes


def _sats(volume: float) -> int:
    return round(volume * 1e8)


class _ReplayBook:
    """Order-by-order book of the replay: order id -> (side, price, sats, created_t), level totals."""

    def __init__(self) -> None:
        self.orders: dict[int, tuple[str, float, int, float]] = {}
        self.levels: dict[str, dict[float, int]] = {"bid": {}, "ask": {}}

    def _add(self, side: str, price: float, sats: int) -> None:
        level = self.levels[side]
        total = level.get(price, 0) + sats
        if total > 0:
            level[price] = total
        else:
            level.pop(price, None)

    def apply(self, t: float, order_id: int, action: str, side: str, price: float,
              volume: float) -> list | None:
        """Apply one order event at feed time t (s); returns the [(side, price)] levels touched,
        or None when a change/delete names an order the book does not hold."""
        old = self.orders.pop(order_id, None)
        if action != "created" and old is None:
            return None
        touched = []
        if old is not None:
            self._add(old[0], old[1], -old[2])
            touched.append((old[0], old[1]))
        if action != "deleted":
            created = old[3] if old is not None else t
            self.orders[order_id] = (side, price, _sats(volume), created)
            self._add(side, price, _sats(volume))
            if (side, price) not in touched:
                touched.append((side, price))
        return touched

    def prune_stale(self, t: float, stale_s: float) -> int:
        """Uncross the book by deleting orders that rest through the opposite best price and
        were created more than stale_s before t (orders whose end the capture never shows,
        e.g. filled between the REST snapshot and the stream). Returns orders deleted."""
        pruned = 0
        while (top := self.top()) is not None and top[0] >= top[1]:
            crossed = [(o[3], oid) for oid, o in self.orders.items()
                       if (o[0] == "bid" and o[1] >= top[1]) or (o[0] == "ask" and o[1] <= top[0])]
            stale = [c for c in crossed if c[0] < t - stale_s]
            if not stale:
                break  # a fresh taker order still matching: a real, transient crossing
            oid = min(stale)[1]
            side, price, sats, _ = self.orders.pop(oid)
            self._add(side, price, -sats)
            pruned += 1
        return pruned

    def size(self, side: str, price: float) -> float:
        return self.levels[side].get(price, 0) / 1e8

    def snapshot(self) -> dict:
        return {side: {str(p): s / 1e8 for p, s in sorted(lv.items())} for side, lv in self.levels.items()}

    def top(self) -> tuple[float, float] | None:
        if not self.levels["bid"] or not self.levels["ask"]:
            return None
        return max(self.levels["bid"]), min(self.levels["ask"])


def bitstamp_messages(capture: BitstampCapture | None = None, *, exchange: str = "BITSTAMP",
                      symbol: str = "BTC-USD", start_s: float = 0.0, duration_s: float | None = None,
                      snapshot_interval: int = 1000, ticker_interval_s: float = 1.0,
                      stale_s: float = 2.0, stats: Counter | None = None) -> Iterator[FeedMessage]:
    """Yield the capture as cryptofeed-style messages, in exchange-time order.

    Args:
        capture: parsed capture (default: load_bitstamp_capture(), which may download it).
        start_s: skip this much of the capture (seconds after the snapshot); the book is
            rebuilt silently up to there and the stream starts with a snapshot.
        duration_s: stop after this much feed time (None: to the end, ~30 min).
        snapshot_interval: a full snapshot every this many deltas (0: only the first).
        ticker_interval_s: a ticker every this many feed seconds (0: none).
        stale_s: before each snapshot, orders resting through the opposite best price for
            longer than this (feed seconds) are deleted, as the venue's own snapshot would not
            show them (the capture holds a few whose end it never records).
        stats: if given, counts "unknown_order_events" (changes/deletes of orders never seen)
            and "stale_orders_pruned".

    Raises:
        MarketDataUnavailable: the capture is not cached and cannot be downloaded.
    """
    capture = capture or load_bitstamp_capture()
    stats = stats if stats is not None else Counter()
    book = _ReplayBook()
    for order_id, side, price, volume in capture.snapshot:
        book.apply(capture.snapshot_ms / 1000.0, order_id, "created", side, price, volume)
    t0 = capture.snapshot_ms / 1000.0 + start_s
    t_end = t0 + duration_s if duration_s is not None else float("inf")
    topic_book, topic_trades = f"{exchange}-book-{symbol}", f"{exchange}-trades-{symbol}"
    seq = 0
    started = False
    deltas_since_snapshot = 0
    next_ticker = t0
    trades = iter(capture.trades)
    trade = next(trades, None)

    def snapshot_msg(t: float) -> FeedMessage:
        nonlocal seq, deltas_since_snapshot
        stats["stale_orders_pruned"] += book.prune_stale(t, stale_s)
        seq += 1
        deltas_since_snapshot = 0
        return FeedMessage(t, topic_book, {"exchange": exchange, "symbol": symbol,
                                           "book": book.snapshot(), "sequence_number": seq})

    for ms, order_id, action, side, price, volume in capture.orders:
        t = ms / 1000.0
        if t > t_end:
            break
        if not started and t >= t0:
            started = True
            yield snapshot_msg(t0)
        while trade is not None and trade[0] / 1000.0 <= t:
            if started:
                tms, trade_id, tside, tprice, amount = trade
                yield FeedMessage(tms / 1000.0, topic_trades, {
                    "exchange": exchange, "symbol": symbol, "side": tside, "amount": amount,
                    "price": tprice, "id": trade_id, "type": None})
            trade = next(trades, None)
        touched = book.apply(t, order_id, action, side, price, volume)
        if touched is None:
            stats["unknown_order_events"] += 1
            continue
        if not started:
            continue
        if ticker_interval_s > 0 and t >= next_ticker:
            top = book.top()
            if top is not None:
                yield FeedMessage(t, f"{exchange}-ticker-{symbol}", {
                    "exchange": exchange, "symbol": symbol, "bid": top[0], "ask": top[1]})
            next_ticker = t + ticker_interval_s
        seq += 1
        delta = {"bid": [], "ask": []}
        for s, p in touched:
            delta[s].append([p, book.size(s, p)])
        yield FeedMessage(t, topic_book, {"exchange": exchange, "symbol": symbol, "delta": delta,
                                          "sequence_number": seq})
        deltas_since_snapshot += 1
        if snapshot_interval and deltas_since_snapshot >= snapshot_interval:
            yield snapshot_msg(t)


def synthetic_messages(seed: int, n: int, *, exchange: str = "SYNTH", symbol: str = "BTC-USD",
                       mid: float = 50_000.0, tick: float = 0.5, depth: int = 10,
                       rate_hz: float = 200.0, trade_prob: float = 0.2, snapshot_interval: int = 500,
                       glitches: dict[str, int] | None = None) -> tuple[list[FeedMessage], Counter]:
    """A seeded random-walk L2 feed with exactly known glitches.

    The book has `depth` levels per side spaced `tick` apart around a mid that moves by one tick
    with probability 0.1 per message; messages are book deltas (one level resized), trades at
    the touch (probability `trade_prob`) and a snapshot every `snapshot_interval` deltas.

    Args:
        glitches: {kind: count} to inject at seeded positions; kinds: "malformed" (not JSON),
            "unknown_channel" (a `funding` message), "bad_price" (trade at price 0),
            "absurd_price" (trade at 10x mid), "bad_size" (trade amount -1), "absurd_size"
            (trade amount 1e9), "out_of_order" (a book delta re-sent with an old sequence
            number), "crossed" (a bid placed above the best ask, removed by the next delta).

    Returns:
        (messages, expected): expected is the Counter of each glitch kind a correct consumer
        must report (one per injected glitch).

    Raises:
        ValueError: unknown glitch kind.
    """
    kinds = {"malformed", "unknown_channel", "bad_price", "absurd_price", "bad_size",
             "absurd_size", "out_of_order", "crossed"}
    glitches = dict(glitches or {})
    if not set(glitches) <= kinds:
        raise ValueError(f"unknown glitch kinds {sorted(set(glitches) - kinds)}; known: {sorted(kinds)}")
    rng = random.Random(seed)
    base = {"exchange": exchange, "symbol": symbol}
    topic = {ch: f"{exchange}-{ch}-{symbol}" for ch in ("book", "trades", "ticker", "funding")}
    center = round(mid / tick)
    sizes = {"bid": {}, "ask": {}}
    for i in range(1, depth + 1):
        sizes["bid"][(center - i) * tick] = round(rng.uniform(0.1, 2.0), 4)
        sizes["ask"][(center + i) * tick] = round(rng.uniform(0.1, 2.0), 4)
    out: list[FeedMessage] = []
    seq = 0
    last_delta: dict | None = None

    def snapshot(t):
        nonlocal seq
        seq += 1
        out.append(FeedMessage(t, topic["book"], {**base, "sequence_number": seq, "book": {
            s: {str(p): v for p, v in sorted(lv.items())} for s, lv in sizes.items()}}))

    def delta(t, side, price, size):
        nonlocal seq, last_delta
        seq += 1
        if size > 0:
            sizes[side][price] = size
        else:
            sizes[side].pop(price, None)
        other = "ask" if side == "bid" else "bid"
        last_delta = {**base, "sequence_number": seq, "delta": {side: [[price, size]], other: []}}
        out.append(FeedMessage(t, topic["book"], last_delta))

    snapshot(0.0)
    glitch_at = {}
    for kind, count in glitches.items():
        for _ in range(count):
            pos = rng.randrange(10, n)
            while pos in glitch_at:
                pos = pos + 1 if pos + 1 < n else 10
            glitch_at[pos] = kind
    deltas = 0
    for i in range(1, n):
        t = i / rate_hz
        best_bid, best_ask = max(sizes["bid"]), min(sizes["ask"])
        kind = glitch_at.get(i)
        if kind == "malformed":
            out.append(FeedMessage(t, topic["trades"], b'{"side": "buy", "price": 5'))
        elif kind == "unknown_channel":
            out.append(FeedMessage(t, topic["funding"], {**base, "rate": 0.0001}))
        elif kind in ("bad_price", "absurd_price", "bad_size", "absurd_size"):
            price = {"bad_price": 0.0, "absurd_price": 10 * best_ask}.get(kind, best_ask)
            amount = {"bad_size": -1.0, "absurd_size": 1e9}.get(kind, 0.01)
            out.append(FeedMessage(t, topic["trades"], {**base, "side": "buy", "price": price,
                                                        "amount": amount, "id": f"g{i}"}))
        elif kind == "out_of_order" and last_delta is not None:
            out.append(FeedMessage(t, topic["book"], {**last_delta, "sequence_number": seq - 1}))
        elif kind == "crossed":
            delta(t, "bid", best_ask + tick, 0.5)
            delta(t, "bid", best_ask + tick, 0.0)
        if kind is not None:
            continue
        r = rng.random()
        if r < trade_prob:
            side = rng.choice(("buy", "sell"))
            price = best_ask if side == "buy" else best_bid
            out.append(FeedMessage(t, topic["trades"], {**base, "side": side, "price": price,
                                                        "amount": round(rng.uniform(0.001, 0.5), 4),
                                                        "id": str(i)}))
            continue
        if r < trade_prob + 0.1:  # the mid moves one tick: shift the whole book
            step = rng.choice((-1, 1))
            center += step
            for side, sign in (("bid", -1), ("ask", 1)):
                new = {(center + sign * k) * tick for k in range(1, depth + 1)}
                for price in sorted(set(sizes[side]) - new):
                    delta(t, side, price, 0.0)
                for price in sorted(new - set(sizes[side])):
                    delta(t, side, price, round(rng.uniform(0.1, 2.0), 4))
        else:
            side = rng.choice(("bid", "ask"))
            delta(t, side, rng.choice(sorted(sizes[side])), round(rng.uniform(0.1, 2.0), 4))
        deltas += 1
        if deltas % snapshot_interval == 0:
            snapshot(t)
    expected = Counter({k: v for k, v in glitches.items()})
    return out, expected


class FeedPublisher:
    """Publishes FeedMessages on an XPUB socket at real or accelerated speed.

    Args:
        endpoint: "tcp://127.0.0.1:5555" or "ipc:///tmp/feed.sock".
        bind: bind instead of connect (cryptofeed convention: the receiver binds).
        multipart: send [topic, json] frames instead of one "topic json" frame.
        sndhwm: send high-water mark, messages (ZeroMQ drops beyond it when the reader lags).

    Raises:
        zmq.ZMQError: the endpoint cannot be bound/connected.
    """

    def __init__(self, endpoint: str, *, bind: bool = False, multipart: bool = False,
                 sndhwm: int = 100_000, context: zmq.Context | None = None) -> None:
        self._sock = (context or zmq.Context.instance()).socket(zmq.XPUB)
        self._sock.setsockopt(zmq.SNDHWM, sndhwm)
        self._sock.setsockopt(zmq.LINGER, 1000)
        (self._sock.bind if bind else self._sock.connect)(endpoint)
        self.multipart = multipart
        self.stats: Counter = Counter()

    def wait_for_subscriber(self, timeout_s: float = 10.0) -> bool:
        """Block until a subscription arrives (True) or timeout_s seconds pass (False)."""
        if self._sock.poll(int(timeout_s * 1000)):
            self._sock.recv()
            return True
        return False

    def send(self, msg: FeedMessage, timestamp: float) -> None:
        """Send one message now with feed timestamp `timestamp` (s since epoch)."""
        if isinstance(msg.payload, bytes):
            body = msg.payload
        else:
            body = json.dumps({**msg.payload, "timestamp": timestamp,
                               "receipt_timestamp": time.time()}).encode()
        topic = msg.topic.encode()
        if self.multipart:
            self._sock.send_multipart([topic, body])
        else:
            self._sock.send(topic + b" " + body)
        self.stats["sent"] += 1
        self.stats["sent_" + msg.topic.split("-")[1]] += 1

    def play(self, messages: Iterable[FeedMessage], *, speed: float = 1.0,
             stop: threading.Event | None = None) -> Counter:
        """Send every message on the feed clock divided by `speed` (0: as fast as possible).

        Returns the stats Counter: "sent", "sent_<channel>" and "late" (messages sent more
        than 10 ms behind their schedule: the publisher itself could not keep up).
        """
        t0 = wall0 = None
        for msg in messages:
            if stop is not None and stop.is_set():
                break
            if t0 is None:
                t0, wall0 = msg.t, time.time()
            if speed > 0:
                due = wall0 + (msg.t - t0) / speed
                delay = due - time.time()
                if delay > 0:
                    time.sleep(delay)
                elif delay < -0.01:
                    self.stats["late"] += 1
            else:
                due = time.time()
            self.send(msg, due)
        return self.stats

    def close(self) -> None:
        """Close the socket (pending messages get up to 1 s to leave)."""
        self._sock.close()


def main(argv: list[str] | None = None) -> int:
    """Console entry `tokenspeed_market_replay`: publish the capture (or a synthetic feed)."""
    parser = argparse.ArgumentParser(description="Replay market data over ZeroMQ (cryptofeed convention).")
    parser.add_argument("--endpoint", default="tcp://127.0.0.1:5555")
    parser.add_argument("--bind", action="store_true", help="bind instead of connect")
    parser.add_argument("--multipart", action="store_true", help="send [topic, json] frames")
    parser.add_argument("--source", choices=("bitstamp", "synthetic"), default="bitstamp")
    parser.add_argument("--speed", type=float, default=1.0, help="feed seconds per wall second (0: max)")
    parser.add_argument("--start", type=float, default=0.0, help="skip this many feed seconds")
    parser.add_argument("--duration", type=float, default=None, help="feed seconds to play")
    parser.add_argument("--snapshot-interval", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0, help="synthetic source seed")
    parser.add_argument("--messages", type=int, default=10_000, help="synthetic source length")
    parser.add_argument("--wait-subscriber", type=float, default=30.0, help="seconds")
    args = parser.parse_args(argv)
    stats: Counter = Counter()
    if args.source == "bitstamp":
        try:
            capture = load_bitstamp_capture()
        except MarketDataUnavailable as err:
            print(f"tokenspeed_market_replay: {err}", file=sys.stderr)
            return 1
        messages = bitstamp_messages(capture, start_s=args.start, duration_s=args.duration,
                                     snapshot_interval=args.snapshot_interval, stats=stats)
    else:
        messages, _ = synthetic_messages(args.seed, args.messages, snapshot_interval=args.snapshot_interval)
    pub = FeedPublisher(args.endpoint, bind=args.bind, multipart=args.multipart)
    if not pub.wait_for_subscriber(args.wait_subscriber):
        print(f"tokenspeed_market_replay: no subscriber on {args.endpoint} after "
              f"{args.wait_subscriber} s", file=sys.stderr)
        return 1
    start = time.perf_counter()
    stats.update(pub.play(messages, speed=args.speed))
    pub.close()
    print(json.dumps({**stats, "wall_s": round(time.perf_counter() - start, 3)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
