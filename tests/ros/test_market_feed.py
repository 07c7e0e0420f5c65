"""The market feed parser and L2 book, record by record (the socket path is in test_market_bridge)."""
import json
import math
import time

import pytest

from tokenspeed_ros.market_feed import FeedLimits, MarketFeed, split_message
from tokenspeed_ros.order_book import L2Book, imbalance

EX, SYM = "TEST", "BTC-USD"


def frame(channel: str, payload, symbol: str = SYM) -> list[bytes]:
    body = payload if isinstance(payload, bytes) else json.dumps({"timestamp": 1.0, **payload}).encode()
    return [f"{EX}-{channel}-{symbol}".encode() + b" " + body]


def snapshot(seq, bids, asks):
    return frame("book", {"book": {"bid": {str(p): s for p, s in bids.items()},
                                   "ask": {str(p): s for p, s in asks.items()}}, "sequence_number": seq})


def delta(seq, bid=(), ask=()):
    return frame("book", {"delta": {"bid": [list(x) for x in bid], "ask": [list(x) for x in ask]},
                          "sequence_number": seq})


def test_book_best_prices_follow_inserts_and_removals():
    book = L2Book()
    for p, s in [(99.0, 1.0), (100.0, 2.0), (98.0, 3.0)]:
        book.set_level("bid", p, s)
    book.set_level("ask", 101.0, 1.0)
    assert book.top() == (100.0, 2.0, 101.0, 1.0)
    book.set_level("bid", 100.0, 0.0)
    assert book.best("bid") == 99.0 and book.mid() == 100.0
    book.set_level("bid", 101.0, 1.0)
    assert book.crossed() and book.mid() is None
    assert imbalance(3.0, 1.0) == 0.5 and imbalance(0.0, 0.0) == 0.0


def test_hand_checked_sequence():
    feed = MarketFeed()
    feed.handle(snapshot(1, {100.0: 1.0, 99.5: 2.0, 99.0: 3.0}, {100.5: 1.5, 101.0: 2.5}))
    feed.handle(delta(2, bid=[(100.0, 0.5)], ask=[(100.5, 0.0)]))
    feed.handle(delta(3, bid=[(100.25, 0.75)], ask=[(100.75, 1.0)]))
    feed.handle(frame("trades", {"side": "buy", "price": 100.75, "amount": 0.2, "id": "t1"}))
    state = feed.symbols[(EX, SYM)]
    assert state.book.levels == {"bid": {100.25: 0.75, 100.0: 0.5, 99.5: 2.0, 99.0: 3.0},
                                 "ask": {100.75: 1.0, 101.0: 2.5}}
    f = state.features()
    assert (f["bid"], f["ask"], f["mid"], f["spread"]) == (100.25, 100.75, 100.5, 0.5)
    assert f["imbalance"] == pytest.approx((0.75 - 1.0) / 1.75)
    assert f["trades"] == [["buy", 100.75, 0.2]] and f["last_trade_price"] == 100.75
    assert feed.counters == {"book_snapshots": 1, "book_deltas": 2, "trades": 1}


def test_gap_drops_the_book_until_the_next_snapshot():
    feed = MarketFeed()
    feed.handle(snapshot(1, {100.0: 1.0}, {101.0: 1.0}))
    feed.handle(delta(2, bid=[(100.0, 2.0)]))
    feed.handle(delta(4, bid=[(99.0, 1.0)]))            # seq 3 lost
    state = feed.symbols[(EX, SYM)]
    assert not state.book.synced and state.features() is None
    feed.handle(delta(5, bid=[(98.0, 1.0)]))            # refused: waiting for a snapshot
    feed.handle(snapshot(6, {100.5: 1.0}, {101.0: 2.0}))
    feed.handle(delta(5, bid=[(97.0, 1.0)]))            # older than the snapshot
    feed.handle(delta(7, ask=[(101.5, 1.0)]))
    assert state.book.levels == {"bid": {100.5: 1.0}, "ask": {101.0: 2.0, 101.5: 1.0}}
    c = feed.counters
    assert (c["seq_gap"], c["unsynced"], c["resyncs"], c["out_of_order"]) == (1, 1, 1, 1)


def test_crossed_book_is_counted_once_and_resynced_when_it_persists():
    feed = MarketFeed(FeedLimits(max_crossed_msgs=3))
    feed.handle(snapshot(1, {100.0: 1.0}, {101.0: 1.0}))
    feed.handle(delta(2, bid=[(101.0, 1.0)]))           # locked: bid == ask
    state = feed.symbols[(EX, SYM)]
    assert state.features() is None
    feed.handle(delta(3, bid=[(101.0, 0.0)]))           # uncrossed again
    assert state.features()["mid"] == 100.5
    for seq in (4, 5, 6):                               # crossed for 3 updates in a row
        feed.handle(delta(seq, bid=[(102.0 + seq, 1.0)]))
    assert feed.counters["crossed"] == 2 and not state.book.synced
    feed.handle(snapshot(7, {100.0: 1.0}, {101.0: 1.0}))
    assert feed.counters["resyncs"] == 1 and state.features() is not None


@pytest.mark.parametrize("frames, kind", [
    ([b"TEST-trades-BTC-USD {not json"], "malformed"),
    ([b"TEST-trades-BTC-USD"], "malformed"),                            # no payload
    ([b"a", b"b", b"c"], "malformed"),                                  # three frames
    ([b"nodashes", b"{}"], "malformed"),                                # bad topic
    ([b"TEST-trades-BTC-USD", b"[1, 2]"], "malformed"),                 # not an object
    (frame("trades", {"side": "buy", "price": "abc", "amount": 1}), "malformed"),
    (frame("trades", {"side": "buy", "price": True, "amount": 1}), "malformed"),
    (frame("trades", {"side": "hold", "price": 100.0, "amount": 1}), "malformed"),
    (frame("book", {"delta": {"bid": [[100.0]]}}), "malformed"),
    (frame("book", {"neither": 1}), "malformed"),
    (frame("funding", {"rate": 0.1}), "unknown_channel"),
    (frame("trades", {"side": "buy", "price": 0.0, "amount": 1.0}), "bad_price"),
    (frame("trades", {"side": "buy", "price": 999999999.0, "amount": 1.0}), "absurd_price"),
    (frame("trades", {"side": "buy", "price": 100.0, "amount": 0.0}), "bad_size"),
    (frame("trades", {"side": "buy", "price": 100.0, "amount": -1.0}), "bad_size"),
    (frame("trades", {"side": "buy", "price": 100.0, "amount": 1e9}), "absurd_size"),
    (frame("ticker", {"bid": 101.0, "ask": 100.0}), "crossed"),
    (frame("ticker", {"bid": 0.0, "ask": 100.0}), "bad_price"),
    # what outside probes sent (each once stopped the feed thread or froze feed time)
    ([b"TEST-trades-BTC-USD " + b"[" * 100_000], "too_large"),           # RecursionError in json
    (frame("trades", b'{"timestamp": 1.0, "side": "buy", "price": 1' + b"0" * 400 + b', "amount": 1}'),
     "bad_price"),                                                       # OverflowError in float()
    (frame("trades", b'{"timestamp": 1' + b"0" * 400 + b', "side": "buy", "price": 100.0, "amount": 1}'),
     "bad_timestamp"),
    (frame("trades", b'{"timestamp": Infinity, "side": "buy", "price": 100.0, "amount": 1}'), "bad_timestamp"),
    (frame("trades", b'{"timestamp": NaN, "side": "buy", "price": 100.0, "amount": 1}'), "bad_timestamp"),
    (frame("trades", {"timestamp": 1e30, "side": "buy", "price": 100.0, "amount": 1}), "bad_timestamp"),
    (frame("trades", {"timestamp": -5.0, "side": "buy", "price": 100.0, "amount": 1}), "bad_timestamp"),
    (frame("trades", {"side": "buy", "price": 100.0, "amount": float("inf")}), "bad_size"),
    (frame("book", {"delta": {"bid": [[100.0, 1.0]]}, "sequence_number": 10 ** 400}), "bad_sequence"),
    (frame("book", {"delta": {"bid": [[100.0, 1.0]]}, "sequence_number": -3}), "bad_sequence"),
    ([b"TEST-book-BTC-USD " + b" " * (2 << 20)], "too_large"),
])
def test_bad_records_are_counted_and_change_nothing(frames, kind):
    feed = MarketFeed()
    feed.handle(snapshot(1, {100.0: 1.0}, {100.5: 1.0}))
    before = feed.counters.copy()
    assert feed.handle(frames) is None
    assert feed.counters - before == {kind: 1}
    assert feed.symbols[(EX, SYM)].book.levels == {"bid": {100.0: 1.0}, "ask": {100.5: 1.0}}


def test_a_trade_stamped_in_the_future_does_not_freeze_feed_time():
    now = time.time()
    feed = MarketFeed()
    feed.handle(frame("trades", {"timestamp": now, "side": "buy", "price": 100.0, "amount": 1.0}))
    feed.handle(frame("trades", {"timestamp": now + 86_400, "side": "buy", "price": 100.0, "amount": 1.0}))
    feed.handle(frame("trades", {"timestamp": now + 0.5, "side": "sell", "price": 100.5, "amount": 2.0}))
    state = feed.symbols[(EX, SYM)]
    assert feed.counters == {"trades": 2, "bad_timestamp": 1}
    assert state.last_trade.price == 100.5 and state.last_timestamp == now + 0.5


def test_book_depth_is_bounded():
    feed = MarketFeed(FeedLimits(max_levels=3))
    feed.handle(snapshot(1, {100.0: 1.0, 99.5: 1.0}, {100.5: 1.0}))
    feed.handle(delta(2, bid=[(99.0, 1.0), (98.5, 1.0), (100.0, 2.0), (99.5, 0.0)]))
    feed.handle(delta(3, bid=[(98.5, 1.0)]))       # room again after the removal
    assert feed.symbols[(EX, SYM)].book.levels["bid"] == {100.0: 2.0, 99.0: 1.0, 98.5: 1.0}
    assert feed.counters["book_full"] == 1


def test_the_number_of_symbols_is_bounded():
    feed = MarketFeed(FeedLimits(max_symbols=2))
    for sym in ("BTC-USD", "ETH-USD", "SOL-USD", "BTC-USD"):
        feed.handle(frame("trades", {"side": "buy", "price": 100.0, "amount": 1.0}, symbol=sym))
    assert set(feed.symbols) == {(EX, "BTC-USD"), (EX, "ETH-USD")}
    assert feed.counters == {"trades": 3, "too_many_symbols": 1}


def test_an_unexpected_exception_is_counted_and_the_record_dropped():
    """A fake fault: a clock that raises stands for a bug inside the parser, which well-formed
    or malformed input can no longer cause."""
    def broken_clock():
        raise RuntimeError("clock read failed")

    feed = MarketFeed(clock=broken_clock)
    assert feed.handle(frame("trades", {"side": "buy", "price": 100.0, "amount": 1.0})) is None
    assert feed.counters == {"internal_error": 1} and "clock read failed" in feed.last_internal_error


def test_bad_levels_are_skipped_inside_an_otherwise_good_update():
    feed = MarketFeed()
    # first snapshot: the reference is the median level price (100.5), robust to the outliers
    feed.handle(snapshot(1, {100.0: 1.0, 0.0: 10.0, 1.0: 5.0, 99.0: 0.0},
                         {100.5: 1.0, 101.0: 1.0, 483980000.0: 0.01, 102.0: 5000.0}))
    feed.handle(delta(2, bid=[(999999999.0, 0.0), (100.25, float("nan"))], ask=[(100.75, 2.0)]))
    state = feed.symbols[(EX, SYM)]
    assert state.book.levels == {"bid": {100.0: 1.0}, "ask": {100.5: 1.0, 100.75: 2.0, 101.0: 1.0}}
    c = feed.counters
    assert (c["bad_price"], c["absurd_price"], c["bad_size"], c["absurd_size"]) == (1, 3, 2, 1)


def test_split_message_forms():
    assert split_message([b"BITSTAMP-book-BTC-USD {}"]) == ("BITSTAMP", "book", "BTC-USD", b"{}")
    assert split_message([b"COINBASE-ticker-ETH-USD", b"{}"]) == ("COINBASE", "ticker", "ETH-USD", b"{}")
    assert math.isclose(MarketFeed().limits.price_band, 0.25)


def test_seeded_synthetic_glitches_are_counted_exactly():
    from tokenspeed_sim.market_replay import synthetic_messages

    glitches = {"malformed": 3, "unknown_channel": 2, "bad_price": 2, "absurd_price": 2, "bad_size": 2,
                "absurd_size": 1, "out_of_order": 3, "crossed": 2}
    messages, expected = synthetic_messages(seed=11, n=3000, glitches=glitches)
    feed = MarketFeed()
    for m in messages:
        body = m.payload if isinstance(m.payload, bytes) else json.dumps({**m.payload, "timestamp": m.t}).encode()
        feed.handle([m.topic.encode() + b" " + body])
    refused = {k: v for k, v in feed.counters.items() if k not in ("book_snapshots", "book_deltas", "trades")}
    assert refused == expected
