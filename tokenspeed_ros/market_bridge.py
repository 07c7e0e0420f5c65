"""`tokenspeed_market_bridge`: a ZeroMQ market-data feed -> a trading agent under a deadline.

Three threads, none waiting on another:

- feed thread: a ZeroMQ SUB socket (cryptofeed convention, see `market_feed`) drained in batches
  of up to `max_batch` messages. Every message updates the per-symbol L2 book / trades; features
  and trigger rules run once per symbol per batch (the rest is counted as `coalesced`), so the
  loop keeps up with the feed; RCVHWM bounds what queues in between (a publisher that outruns
  it drops, which shows up as sequence gaps and resyncs). It publishes tokenspeed_msgs/MarketTick
  summaries and hands triggers (price move, trade burst, timer) to the executor; a newer trigger
  replaces one not yet taken (`triggers_coalesced`). Silence longer than `feed_gap_s` after the
  first message raises the feed-gap alarm (counted as "feed_gap", cleared by the next message).
  It also hands each batch's newest state per symbol to the executor, which streams it into the
  session every `stream_period_s` while the engine has nothing to do (streaming prefill), so a
  decision prefills only its trigger line. One lock (`_lock`) guards everything the feed thread
  shares with the executor: the two hand-overs, the feed's books and counters, `counts` and the
  feed-gap alarm (the feed thread writes them under it and reads its own writes without it; the
  executor reads and writes them under it); the decision loop and the streaming state are the
  executor's alone.
- executor (main) thread: opens one decision per trigger in the shared `DeadlineMonitor`, whose
  deadline is the triggering tick's exchange timestamp + `deadline_budget_s`; sends it to the
  engine when the engine is free (a trigger waiting behind a busy engine is answered "superseded"
  when a newer one arrives). Every outcome - the model's call in time, or `hold` with the reason
  (deadline_missed, invalid, engine_fault, ...) - goes out as an ActionCommand + DeadlineStatus on
  ROS and as JSON on the ZeroMQ PUB socket, topic `{EXCHANGE}-decision-{SYMBOL}`:
  {"decision_id", "exchange", "symbol", "trigger", "tool", "arguments", "source", "met", "reason",
  "tick": {features of the tick answered}, "tick_timestamp", "feed_received_at", "deadline",
  "published_at", "latency_s", "feed_to_published_s", "ttft_s"}  (times: seconds since the epoch;
  latency = publish - tick timestamp; feed_to_published = publish - when the bridge received the
  batch that held the triggering message).
  A result that arrives after its fallback was published is dropped, never sent.
- engine thread: `EngineWorker` (shared with the robot agent) owns the tokenspeed Session.

Counters and the feed-gap alarm go to /diagnostics and, every `status_period_s`, to ZeroMQ topic
`status` (JSON). Run: `tokenspeed_market_bridge --ros-args --params-file tokenspeed_ros/config/market_bridge.yaml`.
"""
from __future__ import annotations

import json
import math
import sys
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import zmq
from diagnostic_msgs.msg import DiagnosticStatus, KeyValue
from pydantic import Field
from rclpy.time import Time
from tokenspeed_msgs.msg import ActionCommand, DeadlineStatus, MarketTick

from tokenspeed_ros.deadline_monitor import DeadlineMonitor, Decision, ModelResult
from tokenspeed_ros.engine_worker import Observed, run_engine_node
from tokenspeed_ros.managed_node import ConfigureError, EngineNode
from tokenspeed_ros.market_feed import INTERNAL_ERROR, FeedLimits, MarketFeed, SymbolState
from tokenspeed_ros.params import MIN_PERIOD_S, AgentParamsError, NodeParams

DEFAULT_SYSTEM_PROMPT = (
    "You trade one crypto pair. Each observation summarises its order book and recent trades "
    "(prices in USD, sizes in BTC, bp = basis point). Reply with exactly one tool call: place_order "
    "to trade, cancel_order to pull resting orders, or hold to do nothing."
)


class MarketBridgeParams(NodeParams):
    """Every parameter of `tokenspeed_market_bridge`. Times in seconds (s), sizes in base units."""

    NODE: ClassVar[str] = "tokenspeed_market_bridge"
    DEFAULT_TOOLS: ClassVar[str] = "trading_tools.json"
    LIVE: ClassVar[frozenset[str]] = frozenset({
        "threads", "deadline_budget_s", "publish_margin_s", "status_period_s", "poll_period_s", "max_batch",
        "feed_gap_s", "tick_period_s", "recent_trades", "move_bps", "burst_trades", "burst_window_s", "timer_s",
        "stream_period_s"})

    # ZeroMQ
    feed_endpoint: str = Field("tcp://127.0.0.1:5555", description="market-data SUB endpoint")
    feed_bind: bool = Field(True, description="bind the SUB socket (cryptofeed: publishers connect)")
    subscribe: list[str] = Field([""], description="topic prefixes to subscribe to ('' = all)")
    rcvhwm: int = Field(100_000, ge=1, le=100_000_000, description="SUB receive high-water mark, messages")
    max_batch: int = Field(2000, ge=1, le=1_000_000, description="messages drained per feed-loop iteration")
    poll_period_s: float = Field(0.05, ge=0.001, le=10.0, description="feed-loop poll timeout (s)")
    decision_endpoint: str = Field("tcp://127.0.0.1:5556", description="decision PUB endpoint")
    decision_bind: bool = Field(True, description="bind the decision PUB socket")

    # ROS topics
    action_topic: str = Field("market/action", description="tokenspeed_msgs/ActionCommand output")
    deadline_status_topic: str = Field("market/deadline_status", description="tokenspeed_msgs/DeadlineStatus output")
    tick_topic: str = Field("market/tick", description="tokenspeed_msgs/MarketTick summaries")
    tick_period_s: float = Field(0.2, ge=0.0, le=3600.0, description="MarketTick period per symbol (s of feed time)")
    status_period_s: float = Field(1.0, ge=MIN_PERIOD_S, le=3600.0, description="/diagnostics and ZeroMQ status period (s)")

    # input checks
    price_band: float = Field(0.25, gt=0.0, le=100.0, description="|price/reference - 1| above this is absurd")
    max_size: float = Field(1000.0, gt=0.0, le=1e15, description="level/trade sizes above this are absurd")
    max_crossed_msgs: int = Field(100, ge=1, le=1_000_000, description="a book crossed this long is resynced")
    feed_gap_s: float = Field(5.0, gt=0.0, le=3600.0, description="silence that raises the feed-gap alarm (s)")

    # observations and triggers
    recent_trades: int = Field(3, ge=0, le=50, description="trades listed in each observation")
    move_bps: float = Field(5.0, gt=0.0, le=100_000.0, description="mid move since the last trigger that triggers (bp)")
    burst_trades: int = Field(5, ge=1, le=1_000_000, description="trades within burst_window_s that trigger")
    burst_window_s: float = Field(1.0, gt=0.0, le=3600.0, description="trade-burst window (s)")
    timer_s: float = Field(10.0, ge=0.0, le=86400.0, description="trigger when nothing else did for this long (s); 0 = off")
    stream_period_s: float = Field(
        2.0, ge=0.0, le=3600.0, description="prefill the market state this often while the engine is idle (s); 0 = off")

    # decisions and the deadline monitor
    deadline_budget_s: float = Field(2.0, gt=0.0, le=600.0, description="tick timestamp -> action deadline (s)")
    publish_margin_s: float = Field(0.02, ge=0.0, le=10.0, description="the engine stops this long before the deadline (s)")
    monitor_period_s: float = Field(0.01, ge=0.001, le=1.0, description="deadline monitor timer period (s)")

    # engine
    agent: bool = Field(True, description="run the trading agent; false = feed summaries only")
    system_prompt: str = Field(DEFAULT_SYSTEM_PROMPT, description="system message of the session")
    # model, threads, tools_file, kv_budget_tokens: see NodeParams


STREAM_OFFERS = 4       # a symbol's state is offered for streaming this often per stream_period_s


@dataclass
class Trigger:
    """Why and on which tick a decision was asked: stamp_s = the tick's exchange timestamp (s);
    received_s = when the bridge received the feed batch that held it (wall clock, s); streamed =
    the symbol's state was prefilled within stream_period_s before it."""

    reason: str
    stamp_s: float
    features: dict
    streamed: bool = False
    received_s: float = 0.0


@dataclass
class _Rules:
    """Trigger state of one symbol (feed-time seconds)."""

    mid_ref: float
    last_t: float
    last_trade_t: float = 0.0
    last_tick_t: float = -math.inf
    last_offer_t: float = -math.inf     # the state last handed to the executor for streaming


def state_text(f: dict) -> str:
    """The market state of one symbol as prefilled into the session, lean (the tokenizer spends
    a token per digit): prices in whole USD (what an order can be placed at), sizes to 3
    significant digits, no filler words.

    Example: "BTC-USD mid 78326 spread 1 imbalance +0.42 vol 0.8bp trades buy 0.121@78326 sell 0.05@78325"
    """
    trades = " ".join(f"{side} {amount:.3g}@{price:.0f}" for side, price, amount in f["trades"]) or "none"
    return (f"{f['symbol']} mid {f['mid']:.0f} spread {f['spread']:g} imbalance {f['imbalance']:+.2f} "
            f"vol {f['volatility_bps']:.1f}bp trades {trades}")


def trigger_text(trigger: Trigger) -> str:
    """What is prefilled when a decision starts: only the trigger line when the state was
    streamed in moments before, else the state too. The move is since the last decision.

    Example: "BTC-USD price_move: mid 78326 (+6.1bp)"
    """
    f = trigger.features
    line = f"{f['symbol']} {trigger.reason}: mid {f['mid']:.0f} ({f['move_bps']:+.1f}bp)"
    return line if trigger.streamed else f"{state_text(f)}\n{line}"


class MarketBridgeNode(EngineNode):
    """The bridge node, a managed (lifecycle) node: see `ManagedNode` for the transitions and
    `MarketBridgeParams` for the parameters. Raises AgentParamsError at construction on bad
    parameters; a bad tool file, model or endpoint (zmq.ZMQError) fails configure.

    Attributes read by tests and the demo (executor thread; `status()` is their consistent
    snapshot): `feed.counters` (feed records, bad input, "feed_gap"), `counts` (triggers,
    coalescing, decisions), `outcomes` (recent decision JSON dicts), `loop.engine_turn_s` (seconds
    from handing a decision to the engine to its result, late ones included), `feed_alarm` (True
    while the feed is silent).
    """

    PARAMS = MarketBridgeParams
    CONFIGURE_ERRORS = (zmq.ZMQError,)

    def __init__(self, **node_kwargs):
        self._zmq: zmq.Context | None = None
        self._feed_thread: threading.Thread | None = None
        self._stop = threading.Event()
        super().__init__("tokenspeed_market_bridge", **node_kwargs)

    def configure(self) -> None:
        """Sockets, feed thread, deadline monitor, topics; compiles the tools and loads the model
        (waits for it). Raises AgentParamsError (also for the tool file), zmq.ZMQError or ConfigureError."""
        p = self.p
        self.feed = MarketFeed(FeedLimits(price_band=p.price_band, max_size=p.max_size,
                                          max_crossed_msgs=p.max_crossed_msgs))
        self.counts: Counter = Counter()
        self.outcomes: deque = deque(maxlen=10_000)
        self.feed_alarm = False
        self._rules: dict[tuple[str, str], _Rules] = {}
        self._open: dict[int, Trigger] = {}          # decision id -> trigger, until its outcome
        self._slot: Trigger | None = None            # feed thread -> executor, newest wins
        self._states: dict[tuple[str, str], dict] = {}  # feed thread -> executor: newest features per symbol
        self._lock = threading.Lock()                # guards what the feed thread shares (module docstring)
        self._streaming = False                      # executor: a streamed state is waiting or being prefilled
        self._streamed_at: dict[tuple[str, str], float] = {}  # executor: feed time of each symbol's last streamed state
        self._stop = threading.Event()

        tools = p.load_tools() if p.agent else None
        self._zmq = zmq.Context()
        self._pub = self._zmq.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 500)
        self._sub = self._zmq.socket(zmq.SUB)
        self._sub.setsockopt(zmq.RCVHWM, p.rcvhwm)
        self._sub.setsockopt(zmq.LINGER, 0)
        (self._pub.bind if p.decision_bind else self._pub.connect)(p.decision_endpoint)
        for prefix in p.subscribe:
            self._sub.setsockopt(zmq.SUBSCRIBE, prefix.encode())
        (self._sub.bind if p.feed_bind else self._sub.connect)(p.feed_endpoint)

        self.monitor = DeadlineMonitor(self, action_topic=p.action_topic, status_topic=p.deadline_status_topic,
                                       budget_s=p.deadline_budget_s, fallback="hold", period_s=p.monitor_period_s,
                                       on_outcome=self._on_outcome, active=lambda: self.active,
                                       thread_priority=p.monitor_thread_priority)
        self._tick_pub = self.create_publisher(MarketTick, p.tick_topic, 10)
        self._wake_trigger = self.create_guard_condition(self._on_trigger)
        self._status_timer = self.create_timer(p.status_period_s, self._publish_status)
        self.start_engine(tools, on_observed=self._on_observed)
        self._feed_thread = threading.Thread(target=self._feed_loop, name="market-feed", daemon=True)
        self._feed_thread.start()
        self.get_logger().info(f"tokenspeed_market_bridge configured: feed {p.feed_endpoint}, decisions "
                               f"{p.decision_endpoint}, budget {p.deadline_budget_s} s, "
                               f"agent {'on, model ' + (p.model or 'embedded') if p.agent else 'off'}")

    def deactivate(self) -> None:
        """Hold goes out (for the decision in progress, or on its own); triggers are counted, not decided."""
        self.loop.stop(self.get_clock().now(), "deactivated")

    def cleanup(self, timeout_s: float = 1.0) -> bool:
        """Stop the feed thread, then the monitor and engine threads (EngineNode), and close the
        sockets, removing the ipc:// files it bound (see ManagedNode.cleanup)."""
        self._stop.set()
        if self._feed_thread is not None:
            self._feed_thread.join(5.0)
            self._feed_thread = None
        stopped = super().cleanup(timeout_s)
        if self._zmq is not None:
            self._sub.close()
            self._pub.close()
            self._zmq.term()
            self._zmq = None
            p = self.p
            for endpoint, bound in ((p.feed_endpoint, p.feed_bind), (p.decision_endpoint, p.decision_bind)):
                if bound and endpoint.startswith("ipc://"):   # ZeroMQ leaves the socket file behind
                    Path(endpoint[len("ipc://"):]).unlink(missing_ok=True)
        return stopped

    def apply_live(self, new: MarketBridgeParams, changed: set[str]) -> None:
        """Apply live parameters (MarketBridgeParams.LIVE): the feed thread and the triggers read
        `self.p` as they go; the rest is pushed here (and in EngineNode.apply_live)."""
        super().apply_live(new, changed)
        if "status_period_s" in changed:
            self._status_timer = self.replace_timer(self._status_timer, new.status_period_s, self._publish_status)

    # ------------------------------------------------------------------ feed thread
    def _feed_loop(self) -> None:
        """Feed-thread body. It cannot die silently: an unexpected exception is counted
        (INTERNAL_ERROR in `counts`) and logged, its batch dropped, and the loop goes on;
        `status()` and /diagnostics report the feed as failed when the thread is not alive."""
        last_rx = None
        while not self._stop.is_set():
            try:
                last_rx = self._feed_batch(last_rx)
            except Exception as err:  # noqa: BLE001 - one bad batch must not stop trading
                with self._lock:
                    self.counts[INTERNAL_ERROR] += 1
                self.get_logger().error(f"feed thread: {err!r} (counted, batch dropped)",
                                        throttle_duration_sec=5.0)

    def _feed_batch(self, last_rx: float | None) -> float | None:
        """Wait up to poll_period_s for messages and apply one batch; returns the monotonic
        time of the last batch received (last_rx when none came)."""
        p = self.p     # live parameters apply from the next batch
        if not self._sub.poll(int(p.poll_period_s * 1000)):
            if not self.feed_alarm and last_rx is not None and time.monotonic() - last_rx > p.feed_gap_s:
                with self._lock:
                    self.feed_alarm = True
                    self.feed.counters["feed_gap"] += 1
                self.get_logger().warning(f"feed-gap alarm: no market data for {p.feed_gap_s} s")
            return last_rx
        touched: dict[int, SymbolState] = {}
        n = 0
        received_s = time.time()
        while n < p.max_batch:
            try:
                frames = self._sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            n += 1
            with self._lock:
                state = self.feed.handle(frames)
            if state is not None:
                touched[id(state)] = state
        last_rx = time.monotonic()
        if self.feed_alarm:
            self.get_logger().info("feed resumed")
        with self._lock:
            self.feed_alarm = False
            self.counts["messages"] += n
            self.counts["coalesced"] += n - len(touched)
            self.counts["max_batch_seen"] = max(self.counts["max_batch_seen"], n)
        for state in touched.values():
            self._evaluate(state, received_s)
        return last_rx

    def _evaluate(self, state: SymbolState, received_s: float) -> None:
        """Features, MarketTick and trigger rules for one symbol after a batch received at
        `received_s` (wall clock, s)."""
        p = self.p
        f = state.features(p.recent_trades)
        if f is None:
            return
        t = f["timestamp"]
        rules = self._rules.get((state.exchange, state.symbol))
        if rules is None:
            rules = self._rules[(state.exchange, state.symbol)] = _Rules(mid_ref=f["mid"], last_t=t)
        move_bps = (f["mid"] / rules.mid_ref - 1.0) * 1e4
        burst = sum(1 for tr in state.trades if tr.timestamp >= t - p.burst_window_s and tr.timestamp > rules.last_trade_t)
        reason = ("price_move" if abs(move_bps) >= p.move_bps else
                  "trade_burst" if burst >= p.burst_trades else
                  "timer" if p.timer_s > 0 and t - rules.last_t >= p.timer_s else None)
        if reason is not None or t - rules.last_tick_t >= p.tick_period_s:
            rules.last_tick_t = t
            self._publish_tick(f)
        if reason is None:
            # the executor streams it if the engine is idle; offered STREAM_OFFERS times per period
            if p.stream_period_s > 0 and t - rules.last_offer_t >= p.stream_period_s / STREAM_OFFERS:
                rules.last_offer_t = t
                with self._lock:
                    self._states[(f["exchange"], f["symbol"])] = f
                self._wake_trigger.trigger()
            return
        f["move_bps"] = move_bps
        rules.mid_ref, rules.last_t = f["mid"], t
        rules.last_trade_t = state.last_trade.timestamp if state.last_trade else 0.0
        with self._lock:
            self.counts[f"trigger_{reason}"] += 1
            if self._slot is not None:
                self.counts["triggers_coalesced"] += 1
            self._slot = Trigger(reason, t, f, received_s=received_s)
        self._wake_trigger.trigger()

    def _publish_tick(self, f: dict) -> None:
        msg = MarketTick(exchange=f["exchange"], symbol=f["symbol"], bid=f["bid"], ask=f["ask"], mid=f["mid"],
                         spread=f["spread"], imbalance=f["imbalance"], last_trade_price=f["last_trade_price"],
                         volatility=f["volatility_bps"] * 1e-4)
        msg.header.stamp = Time(nanoseconds=int(f["timestamp"] * 1e9)).to_msg()
        msg.header.frame_id = f"{f['exchange']}:{f['symbol']}"
        self._tick_pub.publish(msg)

    # ------------------------------------------------------------------ executor thread
    def _count(self, key: str) -> None:
        """Count one `key` event in `counts` (executor thread)."""
        with self._lock:
            self.counts[key] += 1

    def _on_trigger(self) -> None:
        """Guard condition of the feed thread: decide on the newest trigger, then stream the
        newest states."""
        with self._lock:
            (trig, self._slot), (states, self._states) = (self._slot, None), (self._states, {})
        if trig is not None:
            self._decide_on(trig)
        for f in states.values():
            self._stream(f)

    def _stream(self, f: dict) -> None:
        """Streaming prefill: hand the state to the engine every stream_period_s while it has no
        decision and no other state to prefill, so a decision only prefills its trigger line."""
        key = (f["exchange"], f["symbol"])
        if (self.p.stream_period_s <= 0 or self.worker is None or self.worker.state != "ready"
                or f["timestamp"] - self._streamed_at.get(key, -math.inf) < self.p.stream_period_s
                or self.loop.busy or self._streaming):
            return
        self._streamed_at[key] = f["timestamp"]
        self._streaming = True            # cleared when the engine reports it prefilled
        self._count("states_streamed")
        self.worker.observe(f"market:{f['symbol']}", state_text(f), f["timestamp"])

    def _decide_on(self, trig: Trigger) -> None:
        f = trig.features
        trig.streamed = trig.stamp_s - self._streamed_at.get((f["exchange"], f["symbol"]), -math.inf) \
            <= self.p.stream_period_s
        if not self.active:
            self._count("triggers_inactive")
            return
        d = self.loop.open(Time(nanoseconds=int(trig.stamp_s * 1e9), clock_type=self.get_clock().clock_type))
        self._open[d.decision_id] = trig
        self._count("decisions_opened")
        prefill = (f"trigger:{trig.features['symbol']}", trigger_text(trig), trig.stamp_s)
        if not self.loop.busy:
            self.loop.dispatch(d, prefill=prefill)
        else:   # waits for the engine; a newer trigger supersedes it
            self.loop.defer(lambda: self.loop.dispatch(d, prefill=prefill), replaced=lambda: self._supersede(d))

    def _supersede(self, d: Decision) -> None:
        """A newer trigger replaced `d` while it waited for the engine: answer it "superseded"."""
        if self.monitor.is_pending(d.decision_id):
            self.monitor.resolve(ModelResult(d.decision_id, "superseded"))

    def _on_observed(self, item: Observed) -> None:
        self._streaming &= not item.source.startswith("market:")

    def _on_outcome(self, cmd: ActionCommand | None, status: DeadlineStatus) -> None:
        """DeadlineMonitor hook, every decision outcome: count it and publish the decision JSON
        on ZeroMQ."""
        self._count(f"outcome_{status.reason}")
        if cmd is None:
            return  # a late model result, dropped: its fallback went out at the deadline
        trig = self._open.pop(status.decision_id, None)
        now = time.time()
        stamp_s = Time.from_msg(status.observation_stamp).nanoseconds * 1e-9
        deadline_s = Time.from_msg(status.deadline).nanoseconds * 1e-9
        f = trig.features if trig else {}
        out = {"decision_id": status.decision_id, "exchange": f.get("exchange", ""), "symbol": f.get("symbol", ""),
               "trigger": trig.reason if trig else "", "tool": cmd.tool_name,
               "arguments": json.loads(cmd.arguments_json), "source": cmd.source, "met": status.met,
               "reason": status.reason, "tick": f, "tick_timestamp": stamp_s,
               "feed_received_at": trig.received_s if trig else None, "deadline": deadline_s, "published_at": now,
               "latency_s": cmd.decision_latency_s, "ttft_s": cmd.ttft_s,
               "feed_to_published_s": now - trig.received_s if trig and trig.received_s else None}
        self.outcomes.append(out)
        topic = f"{out['exchange'] or 'UNKNOWN'}-decision-{out['symbol'] or 'UNKNOWN'}"
        self._pub.send(topic.encode() + b" " + json.dumps(out).encode())

    def status(self) -> dict:
        """Feed counters, bridge counts and decision counts as one JSON-able dict; `feed_health`
        is [level name ("OK", "WARN", "ERROR"), message] of the feed, see `_feed_health`.
        A consistent snapshot (taken under the feed thread's lock)."""
        with self._lock:
            return self._status()

    def _status(self) -> dict:
        return {"feed": dict(self.feed.counters), "bridge": dict(self.counts),
                "decisions": dict(self.monitor.counts), "feed_alarm": self.feed_alarm,
                "feed_health": self._feed_health(),
                "symbols": {f"{ex}-{sym}": {"synced": s.book.synced, "levels": s.book.depth(),
                                            "trades": len(s.trades)} for (ex, sym), s in list(self.feed.symbols.items())},
                "engine": self.worker.state if self.worker else "off"}

    def _feed_health(self) -> tuple[str, str]:
        """(DiagnosticStatus level name, message): ERROR when the feed thread is dead or the feed
        is silent, WARN after unexpected exceptions (counted as "internal_error"), else OK."""
        if (self._feed_thread is None or not self._feed_thread.is_alive()) and not self._stop.is_set():
            return "ERROR", "feed thread dead: no market data is processed"
        if self.feed_alarm:
            return "ERROR", "feed-gap alarm: no market data"
        errors = self.feed.counters[INTERNAL_ERROR] + self.counts[INTERNAL_ERROR]
        if errors:
            return "WARN", (f"receiving; {errors} internal errors (records dropped), "
                            f"last: {self.feed.last_internal_error}")
        return "OK", "receiving"

    def _publish_status(self) -> None:
        status = self.status()
        self._pub.send(b"status " + json.dumps(status).encode())
        level, message = status["feed_health"]
        feed = DiagnosticStatus(
            name=f"{self.get_fully_qualified_name()}: feed", level=getattr(DiagnosticStatus, level), message=message,
            values=[KeyValue(key=k, value=str(v)) for k, v in sorted({**status["feed"], **status["bridge"]}.items())])
        self.publish_diagnostics(feed)


def main(args: list[str] | None = None) -> int:
    """Console entry point `tokenspeed_market_bridge`. Returns 0 on a clean shutdown, 2 on bad
    parameters or a failed start-up configure (tool file, model, an endpoint that cannot be opened)."""
    return run_engine_node("tokenspeed_market_bridge", MarketBridgeNode,
                           (AgentParamsError, ConfigureError), args,
                           MarketBridgeParams.help_text())


if __name__ == "__main__":
    sys.exit(main())
