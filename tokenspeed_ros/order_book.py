"""L2 order book of one symbol, with sequence tracking for resync.

Prices and sizes are floats in the feed's units (BTC-USD: USD per BTC, BTC). The book stores
price level -> total resting size per side plus a sorted price list per side, so a level update
costs a dict write and, for a new or removed level, one bisect and a list insert/delete.
"""
from __future__ import annotations

import bisect
import math

BID = "bid"
ASK = "ask"
SIDES = (BID, ASK)


class L2Book:
    """Aggregated (price level) order book of one symbol.

    Attributes:
        levels: {"bid": {price: size}, "ask": {price: size}}; size > 0 always.
        sequence: sequence number of the last applied update, or None when the feed has none.
        synced: True once a snapshot has been applied and no gap/corruption was seen since;
            deltas are only applied to a synced book.
    """

    def __init__(self) -> None:
        self.levels: dict[str, dict[float, float]] = {BID: {}, ASK: {}}
        self._prices: dict[str, list[float]] = {BID: [], ASK: []}  # ascending
        self.sequence: int | None = None
        self.synced = False

    def clear(self) -> None:
        """Remove every level; the book stays unsynced until the next snapshot."""
        for side in SIDES:
            self.levels[side].clear()
            self._prices[side].clear()
        self.sequence = None
        self.synced = False

    def set_level(self, side: str, price: float, size: float) -> None:
        """Set the total size at one price level; size 0 removes the level.

        Raises:
            KeyError: side is not "bid" or "ask".
        """
        book = self.levels[side]
        if size <= 0.0:
            if book.pop(price, None) is not None:
                prices = self._prices[side]
                del prices[bisect.bisect_left(prices, price)]
            return
        if price not in book:
            bisect.insort(self._prices[side], price)
        book[price] = size

    def best(self, side: str) -> float | None:
        """Best price of one side (highest bid, lowest ask), or None when the side is empty."""
        prices = self._prices[side]
        if not prices:
            return None
        return prices[-1] if side == BID else prices[0]

    def top(self) -> tuple[float, float, float, float] | None:
        """(bid, bid_size, ask, ask_size) of the top of book, or None when a side is empty."""
        bid, ask = self.best(BID), self.best(ASK)
        if bid is None or ask is None:
            return None
        return bid, self.levels[BID][bid], ask, self.levels[ASK][ask]

    def crossed(self) -> bool:
        """True when the best bid is at or above the best ask (an inconsistent book)."""
        bid, ask = self.best(BID), self.best(ASK)
        return bid is not None and ask is not None and bid >= ask

    def mid(self) -> float | None:
        """Mid price of an uncrossed book with both sides, else None."""
        top = self.top()
        if top is None or top[0] >= top[2]:
            return None
        return 0.5 * (top[0] + top[2])

    def depth(self) -> int:
        """Total number of price levels on both sides."""
        return len(self.levels[BID]) + len(self.levels[ASK])


def imbalance(bid_size: float, ask_size: float) -> float:
    """Top-of-book imbalance (bid_size - ask_size) / (bid_size + ask_size), in [-1, 1]."""
    total = bid_size + ask_size
    return 0.0 if total <= 0.0 or not math.isfinite(total) else (bid_size - ask_size) / total
