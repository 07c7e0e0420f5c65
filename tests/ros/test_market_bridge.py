"""The market bridge over real sockets: ZeroMQ in (ipc://), decisions out on ZeroMQ and DDS.

The bridge node runs in this process (its feed and engine threads are real threads, its
publishers real DDS); the feed comes from tokenspeed_sim's XPUB publisher or from the replay
running as a child process.
"""
import json
import subprocess
import sys
import time

import pytest
import rclpy
import zmq
from rclpy.executors import SingleThreadedExecutor
from rclpy.parameter import Parameter
from tokenspeed_msgs.msg import ActionCommand, DeadlineStatus, MarketTick

from support import BIN, ROOT, spin_until, stop
from tokenspeed_ros.market_bridge import MarketBridgeNode
from tokenspeed_sim.market_data import MarketDataUnavailable, fetch_bitstamp_capture
from tokenspeed_sim.market_replay import FeedMessage, FeedPublisher, synthetic_messages

EX, SYM = "TEST", "BTC-USD"


@pytest.fixture
def ros(ros_env):
    rclpy.init()
    executor = SingleThreadedExecutor()
    nodes = []
    yield executor, nodes
    stopped = True
    for node in nodes:
        if isinstance(node, MarketBridgeNode):
            stopped &= node.close(timeout_s=120.0)   # a decision may still be running
        node.destroy_node()
    rclpy.try_shutdown()
    assert stopped, "engine thread still busy at teardown"


@pytest.fixture
def bitstamp_capture():
    """The real Bitstamp capture is cached (downloaded if needed), else the test is skipped."""
    try:
        fetch_bitstamp_capture()
    except MarketDataUnavailable as e:
        pytest.skip(f"market capture not cached and registry unreachable: {e}")


def start_bridge(ros, tmp_path, **params) -> tuple[MarketBridgeNode, str, str]:
    executor, nodes = ros
    feed, decisions = f"ipc://{tmp_path}/feed", f"ipc://{tmp_path}/decisions"
    values = {"feed_endpoint": feed, "decision_endpoint": decisions, "agent": False, **params}
    node = MarketBridgeNode(parameter_overrides=[Parameter(k, value=v) for k, v in values.items()])
    nodes.append(node)
    executor.add_node(node)
    assert spin_until(executor, lambda: node.active, 300)      # autostart: on the executor's first step
    return node, feed, decisions


def book(seq, bids, asks):
    return FeedMessage(0.0, f"{EX}-book-{SYM}", {"exchange": EX, "symbol": SYM, "sequence_number": seq, "book": {
        "bid": {str(p): s for p, s in bids.items()}, "ask": {str(p): s for p, s in asks.items()}}})


def delta(seq, bid=(), ask=()):
    return FeedMessage(0.0, f"{EX}-book-{SYM}", {"exchange": EX, "symbol": SYM, "sequence_number": seq,
                                                  "delta": {"bid": [list(x) for x in bid], "ask": [list(x) for x in ask]}})


def trade(price, amount, side="buy"):
    return FeedMessage(0.0, f"{EX}-trades-{SYM}", {"exchange": EX, "symbol": SYM, "side": side,
                                                    "price": price, "amount": amount, "id": "t"})


def test_book_gap_resync_and_every_bad_input_over_zmq(ros, tmp_path):
    executor, nodes = ros
    node, feed_ep, _ = start_bridge(ros, tmp_path, feed_gap_s=0.5, tick_period_s=0.0, max_crossed_msgs=3)
    listener = rclpy.create_node("tick_listener")
    nodes.append(listener)
    executor.add_node(listener)
    ticks = []
    listener.create_subscription(MarketTick, "market/tick", ticks.append, 50)
    assert spin_until(executor, lambda: listener.count_publishers("market/tick") > 0, 10.0)

    pub = FeedPublisher(feed_ep)
    assert pub.wait_for_subscriber(10.0)
    sequence = [
        book(1, {100.0: 1.0, 99.5: 2.0, 99.0: 3.0}, {100.5: 1.5, 101.0: 2.5}),
        delta(2, bid=[(100.0, 0.5)], ask=[(100.5, 0.0)]),
        delta(3, bid=[(100.25, 0.75)], ask=[(100.75, 1.0)]),
        trade(100.75, 0.2),
        # bad input, each kind once
        FeedMessage(0.0, f"{EX}-trades-{SYM}", b'{"side": "buy", "pri'),           # malformed
        FeedMessage(0.0, f"{EX}-funding-{SYM}", {"rate": 0.0001}),                  # unknown channel
        trade(0.0, 1.0),                                                            # bad price
        trade(999999999.0, 1.0),                                                    # absurd price
        trade(100.5, -2.0),                                                         # bad size
        trade(100.5, 1e9),                                                          # absurd size
        delta(2, bid=[(50.0, 1.0)]),                                                # out of order
        delta(4, bid=[(101.0, 1.0)]),                                               # crossed ...
        delta(5, bid=[(101.0, 0.0)]),                                               # ... and back
        delta(7, bid=[(99.75, 1.0)]),                                               # gap: 6 lost
        delta(8, bid=[(99.8, 1.0)]),                                                # unsynced
        book(9, {100.0: 1.0, 99.5: 2.0}, {100.5: 1.0}),                             # resync
        delta(10, ask=[(100.75, 3.0)]),
    ]
    for i, msg in enumerate(sequence):
        pub.multipart = i % 2 == 1           # both wire forms of the cryptofeed convention
        pub.send(msg, time.time())
        if i == 3:  # the hand-checked book gets its own MarketTick; take it before the next ones come
            # (the tick publisher keeps the last 10: later ticks would overwrite it if we waited)
            assert spin_until(executor, lambda: any(t.bid == 100.25 and t.ask == 100.75 and t.last_trade_price == 100.75
                                                    for t in ticks), 10.0), node.status()
    assert spin_until(executor, lambda: node.counts["messages"] == len(sequence), 10.0), node.status()

    state = node.feed.symbols[(EX, SYM)]
    assert state.book.levels == {"bid": {100.0: 1.0, 99.5: 2.0}, "ask": {100.5: 1.0, 100.75: 3.0}}
    c = node.feed.counters
    bad = {k: c[k] for k in ("malformed", "unknown_channel", "bad_price", "absurd_price", "bad_size",
                             "absurd_size", "out_of_order", "crossed", "seq_gap", "unsynced")}
    assert bad == dict.fromkeys(bad, 1)
    assert (c["resyncs"], c["book_snapshots"], c["trades"]) == (1, 2, 1)

    # MarketTick summaries over DDS; the last one is the resynced book
    assert spin_until(executor, lambda: ticks and ticks[-1].ask == 100.5, 10.0)
    assert ticks[-1].mid == 100.25 and ticks[-1].imbalance == 0.0 and ticks[-1].exchange == EX

    # feed silence raises the alarm, the next message clears it
    assert spin_until(executor, lambda: node.feed_alarm, 5.0)
    assert node.feed.counters["feed_gap"] == 1 and node.status()["feed_alarm"]
    pub.send(delta(11, bid=[(99.0, 1.0)]), time.time())
    assert spin_until(executor, lambda: not node.feed_alarm, 5.0)
    pub.close()


def test_missed_deadline_publishes_hold_never_a_late_order(ros, tmp_path):
    """The real engine (tiny random model) under a tight budget. Ticks that are already past
    their deadline get `hold` without engine work; live ticks reach the engine, and whatever it
    does, a decision is either a model call published in time or `hold` - never a late order.
    Checked on ZeroMQ and on ROS."""
    executor, nodes = ros
    budget = 0.3
    node, feed_ep, decision_ep = start_bridge(ros, tmp_path, agent=True, model="tiny-random",
                                              deadline_budget_s=budget, timer_s=0.3,
                                              move_bps=1000.0, burst_trades=1000)
    listener = rclpy.create_node("action_listener")
    nodes.append(listener)
    executor.add_node(listener)
    actions, statuses = [], []
    listener.create_subscription(ActionCommand, "market/action", actions.append, 100)
    listener.create_subscription(DeadlineStatus, "market/deadline_status", statuses.append, 100)
    assert spin_until(executor, lambda: node.worker.state != "loading", 180.0)
    assert node.worker.state == "ready", node.worker.fault
    assert spin_until(executor, lambda: listener.count_publishers("market/action") > 0, 10.0)
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(decision_ep)

    messages, _ = synthetic_messages(seed=3, n=400, exchange=EX, rate_hz=150.0)
    pub = FeedPublisher(feed_ep)
    assert pub.wait_for_subscriber(10.0)
    stale = time.time() - 10.0
    for i, msg in enumerate(messages[:100]):      # 0.66 s of feed stamped 10 s ago
        pub.send(msg, stale + msg.t)
        if i % 10 == 9:
            time.sleep(0.02)                      # separate batches: the timer sees feed time pass
    assert spin_until(executor, lambda: node.counts["decisions_opened"] >= 1 and node.monitor.pending == 0, 30.0)
    stale_outcomes = list(node.outcomes)
    for msg in messages[100:]:                     # ~2 s of live feed, spinning in between
        pub.send(msg, time.time())
        executor.spin_once(timeout_sec=1 / 150)
    assert spin_until(executor, lambda: node.counts["decisions_opened"] >= len(stale_outcomes) + 3
                      and node.monitor.pending == 0
                      and len(node.outcomes) == node.counts["decisions_opened"], 60.0), node.status()
    spin_until(executor, lambda: False, 1.0)   # late engine results (dropped) and DDS delivery

    decisions = []
    while sub.poll(100):
        topic, body = sub.recv().split(b" ", 1)
        if topic != b"status":
            assert topic == f"{EX}-decision-{SYM}".encode()
            decisions.append(json.loads(body))
    sub.close()
    pub.close()
    outcomes = list(node.outcomes)
    assert stale_outcomes and all((o["tool"], o["source"], o["reason"]) == ("hold", "fallback", "deadline_missed")
                                  for o in stale_outcomes)
    for o in outcomes:
        assert o["deadline"] == pytest.approx(o["tick_timestamp"] + budget, abs=1e-6)
        assert 0 < o["feed_to_published_s"] == pytest.approx(o["published_at"] - o["feed_received_at"])
        if o["source"] == "model":             # in time, or it would not have been published
            assert o["met"] and o["published_at"] <= o["deadline"] + 0.005 and o["latency_s"] <= budget + 0.005
        else:
            assert (o["tool"], o["arguments"], o["met"]) == ("hold", {}, False)
            assert o["reason"] in ("deadline_missed", "superseded", "invalid", "text")
    assert node.loop.engine_turn_s, "no decision reached the engine"
    assert [d["decision_id"] for d in decisions] == [o["decision_id"] for o in outcomes]
    fallbacks = [a for a in actions if a.source == "fallback"]
    assert len(fallbacks) == sum(o["source"] == "fallback" for o in outcomes) and all(a.tool_name == "hold" for a in fallbacks)
    assert len(statuses) >= len(outcomes) and sum(s.met for s in statuses) == node.monitor.counts["met"]


def _replay_into_bridge(ros, tmp_path, speed: float, duration_s: float):
    executor, _ = ros
    node, feed_ep, _ = start_bridge(ros, tmp_path)
    replay = subprocess.run([sys.executable, "-m", "tokenspeed_sim.market_replay", "--endpoint", feed_ep,
                             "--speed", str(speed), "--duration", str(duration_s)],
                            capture_output=True, text=True, timeout=duration_s / speed + 120)
    assert replay.returncode == 0, replay.stderr
    sent = json.loads(replay.stdout.strip().splitlines()[-1])
    assert spin_until(executor, lambda: node.counts["messages"] == sent["sent"], 30.0), (sent, node.status())
    return node, sent


def _assert_kept_up(node, sent):
    c = node.feed.counters
    # every sequence number arrived in order: nothing dropped between replay and bridge
    assert c["seq_gap"] == 0 and c["out_of_order"] == 0
    # every book message applied, or refused while the book waited for a snapshot after a long
    # crossed state (the capture's stale orders) - none lost
    assert c["book_snapshots"] + c["book_deltas"] + c["unsynced"] == sent["sent_book"]
    assert c["trades"] == sent.get("sent_trades", 0)
    # bounded state: a book of the real price levels in the band, bounded trade/return windows
    (state,) = node.feed.symbols.values()
    assert state.book.synced and 100 < state.book.depth() < 5000
    assert len(state.trades) <= state.trades.maxlen and len(state.returns) <= state.returns.maxlen
    assert node.counts["max_batch_seen"] <= node.p.max_batch
    # the capture's messy records were met and survived
    assert c["absurd_price"] > 0 and c["crossed"] > 0 and c["absurd_size"] > 0


@pytest.mark.usefixtures("bitstamp_capture")
def test_bridge_keeps_up_with_the_real_capture_at_10x(ros, tmp_path):
    node, sent = _replay_into_bridge(ros, tmp_path, speed=10.0, duration_s=60.0)
    _assert_kept_up(node, sent)


@pytest.mark.usefixtures("bitstamp_capture")
@pytest.mark.slow
def test_bridge_keeps_up_with_the_whole_capture_at_10x(ros, tmp_path):
    node, sent = _replay_into_bridge(ros, tmp_path, speed=10.0, duration_s=1800.0)
    _assert_kept_up(node, sent)
    assert node.feed.counters["bad_price"] > 0   # price-0 and 999999999 market orders


@pytest.mark.slow
def test_embedded_model_answers_ticks_with_bounded_trading_calls(ros, tmp_path):
    """The embedded SmolLM2 with a generous budget: model decisions come back as valid calls of
    engine/data/tools/trading_tools.json (enums and bounds respected)."""
    executor, _ = ros
    node, feed_ep, _ = start_bridge(ros, tmp_path, agent=True, deadline_budget_s=60.0, timer_s=1.0,
                                    move_bps=1000.0, burst_trades=1000)
    assert spin_until(executor, lambda: node.worker.state != "loading", 300.0)
    assert node.worker.state == "ready", node.worker.fault
    messages, _ = synthetic_messages(seed=5, n=600, exchange=EX, rate_hz=200.0)
    pub = FeedPublisher(feed_ep)
    assert pub.wait_for_subscriber(10.0)
    for msg in messages:
        pub.send(msg, time.time())
        executor.spin_once(timeout_sec=1 / 200)
    assert spin_until(executor, lambda: any(o["source"] == "model" for o in node.outcomes), 240.0), node.status()
    pub.close()
    for o in (o for o in node.outcomes if o["source"] == "model"):
        args = o["arguments"]
        assert o["met"] and o["tool"] in ("place_order", "cancel_order", "hold")
        if o["tool"] == "place_order":
            assert args["side"] in ("buy", "sell") and args["order_type"] in ("limit", "market")
            assert 0.001 <= args["size"] <= 0.05 and -50 <= args["offset_bps"] <= 50
        elif o["tool"] == "cancel_order":
            assert args["scope"] in ("all", "buy", "sell")


@pytest.mark.usefixtures("bitstamp_capture")
def test_bridge_process_with_its_params_file(probe, ros_env, tmp_path):
    """`tokenspeed_market_bridge` as its own process with tokenspeed_ros/config/market_bridge.yaml, fed
    by the replay process: MarketTick and /diagnostics over DDS, status JSON over ZeroMQ, the
    feed-gap alarm when the replay ends, and a clean SIGINT shutdown."""
    from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus

    feed_ep, decision_ep = f"ipc://{tmp_path}/feed", f"ipc://{tmp_path}/decisions"
    ticks = probe.listen(MarketTick, "market/tick")
    diags = probe.listen(DiagnosticArray, "/diagnostics")
    log = tmp_path / "bridge.log"
    bridge = subprocess.Popen(
        [str(BIN / "tokenspeed_market_bridge"), "--ros-args", "--params-file",
         str(ROOT / "tokenspeed_ros" / "config" / "market_bridge.yaml"), "-p", "agent:=false", "-p", "feed_gap_s:=1.0",
         "-p", f"feed_endpoint:={feed_ep}", "-p", f"decision_endpoint:={decision_ep}"],
        env=ros_env, cwd=ROOT, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"status ")
    sub.connect(decision_ep)
    try:
        assert probe.spin_until(lambda: probe.node.count_publishers("market/tick") > 0, 30.0), log.read_text()
        replay = subprocess.run([str(BIN / "tokenspeed_market_replay"), "--endpoint", feed_ep, "--speed", "10",
                                 "--duration", "20"], env=ros_env, capture_output=True, text=True, timeout=120)
        assert replay.returncode == 0, replay.stderr
        sent = json.loads(replay.stdout.strip().splitlines()[-1])

        def feed_status():
            for arr in reversed(diags):
                for s in arr.status:
                    if s.name == "/tokenspeed_market_bridge: feed":
                        return s
            return None

        assert probe.spin_until(lambda: feed_status() is not None
                                 and feed_status().level == DiagnosticStatus.ERROR, 30.0), log.read_text()
        values = {kv.key: kv.value for kv in feed_status().values}
        assert int(values["messages"]) == sent["sent"] and int(values["feed_gap"]) == 1
        assert "feed-gap alarm" in feed_status().message
        assert ticks and all(t.exchange == "BITSTAMP" and t.symbol == "BTC-USD" and t.bid < t.ask for t in ticks)
        status = {}
        while not status.get("feed_alarm") and sub.poll(5000):   # the newest status has the alarm
            status = json.loads(sub.recv().split(b" ", 1)[1])
        assert status["feed_alarm"] and status["feed"]["book_deltas"] > 0 and status["engine"] == "off"
        assert status["bridge"]["messages"] == sent["sent"]
    finally:
        sub.close()
        assert stop(bridge) == 0, log.read_text()


def test_default_trading_tools():
    """(market_bridge.yaml itself is checked with the other launch files in test_launch.py.)"""
    from tokenspeed_ros.market_bridge import MarketBridgeParams

    tools = json.loads(MarketBridgeParams().resolved_tools_file().read_text())
    assert [t["function"]["name"] for t in tools] == ["place_order", "cancel_order", "hold"]


def test_bad_parameters_are_refused_by_name(ros, tmp_path):
    from tokenspeed_ros.params import AgentParamsError

    with pytest.raises(AgentParamsError, match="timer_s refused: .*INTEGER.*DOUBLE.*; range \\[0, 86400\\]"):
        MarketBridgeNode(parameter_overrides=[Parameter("timer_s", value=5)])       # fixed types: 5.0, not 5
    with pytest.raises(AgentParamsError, match="deadline_budget_s"):
        MarketBridgeNode(parameter_overrides=[Parameter("deadline_budget_s", value=True)])
    with pytest.raises(AgentParamsError, match="price_band"):
        MarketBridgeNode(parameter_overrides=[Parameter("price_band", value=-1.0)])


def raw(channel: str, body: bytes) -> FeedMessage:
    """A record sent verbatim (its timestamp is whatever the body says)."""
    return FeedMessage(0.0, f"{EX}-{channel}-{SYM}", body)


def test_hostile_records_never_stop_trading(ros, tmp_path):
    """What outside probes sent over ZeroMQ: each of these once killed the feed thread (or froze
    feed time with a future trade) while the status still said synced. Now each is counted and
    dropped, and the next good records still make ticks, triggers and decisions."""
    executor, _ = ros
    node, feed_ep, _ = start_bridge(ros, tmp_path, tick_period_s=0.0, move_bps=1.0, timer_s=0.0, feed_gap_s=60.0)
    pub = FeedPublisher(feed_ep)
    assert pub.wait_for_subscriber(10.0)
    now = time.time()
    digits = b"1" + b"0" * 400
    hostile = [
        raw("trades", b"[" * 100_000),                                                      # RecursionError
        raw("trades", b'{"timestamp": %f, "side": "buy", "price": %s, "amount": 1}' % (now, digits)),
        raw("trades", b'{"timestamp": %s, "side": "buy", "price": 100.0, "amount": 1}' % digits),
        raw("trades", b'{"timestamp": Infinity, "side": "buy", "price": 100.0, "amount": 1}'),
        raw("trades", b'{"timestamp": 1e30, "side": "buy", "price": 100.0, "amount": 1}'),
        raw("book", b'{"timestamp": %f, "sequence_number": %s, "delta": {"bid": [[100.0, 1.0]]}}' % (now, digits)),
    ]
    pub.send(book(1, {100.0: 1.0, 99.5: 2.0}, {100.5: 1.0, 101.0: 2.0}), now)
    pub.send(trade(100.5, 0.1), now)
    pub.send(trade(100.5, 0.1), now + 86_400)                                            # a day ahead
    for msg in hostile:
        pub.send(msg, now)
    # good records after them: the book moves, trades (stamped now) are accepted again
    for i, msg in enumerate([delta(2, bid=[(100.25, 1.0)]), trade(100.75, 0.2, side="sell"),
                             delta(3, ask=[(100.5, 0.0)])]):
        time.sleep(0.1)    # separate batches: each one is evaluated (and may trigger) on its own
        pub.send(msg, now + 0.1 * (i + 1))
    n = 3 + len(hostile) + 3
    assert spin_until(executor, lambda: node.counts["messages"] == n and node.counts["trigger_price_move"] == 2
                      and node.counts["decisions_opened"] >= 1, 10.0), node.status()
    c = node.feed.counters
    assert (c["too_large"], c["bad_price"], c["bad_timestamp"], c["bad_sequence"]) == (1, 1, 4, 1), dict(c)
    assert c["trades"] == 2 and node.feed.symbols[(EX, SYM)].last_trade.price == 100.75
    status = node.status()
    assert status["feed_health"] == ("OK", "receiving")
    assert node._feed_thread.is_alive() and c["internal_error"] == 0 and node.counts["internal_error"] == 0
    pub.close()


def test_an_exception_in_the_feed_thread_is_counted_and_reported(ros, tmp_path, monkeypatch):
    """A fake fault: `_evaluate` is made to raise once, standing for a bug that valid or invalid
    market data can no longer cause. The thread survives, the error is counted, the status and
    /diagnostics say WARN, and the next batch is processed."""
    from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus

    executor, nodes = ros
    node, feed_ep, _ = start_bridge(ros, tmp_path, tick_period_s=0.0, status_period_s=0.2)
    listener = rclpy.create_node("diag_listener")
    nodes.append(listener)
    executor.add_node(listener)
    diags = []
    listener.create_subscription(DiagnosticArray, "/diagnostics", diags.append, 10)
    real_evaluate, calls = node._evaluate, []

    def evaluate_once_broken(state, received_s):
        calls.append(state)
        if len(calls) == 1:
            raise RuntimeError("injected fault")
        real_evaluate(state, received_s)

    monkeypatch.setattr(node, "_evaluate", evaluate_once_broken)
    pub = FeedPublisher(feed_ep)
    assert pub.wait_for_subscriber(10.0)
    pub.send(book(1, {100.0: 1.0}, {100.5: 1.0}), time.time())
    assert spin_until(executor, lambda: node.counts["internal_error"] == 1, 10.0), node.status()
    time.sleep(0.2)
    pub.send(delta(2, bid=[(100.25, 1.0)]), time.time())
    assert spin_until(executor, lambda: len(calls) == 2 and node.counts["messages"] == 2, 10.0), node.status()
    assert node._feed_thread.is_alive() and node.status()["feed_health"][0] == "WARN"

    def feed_warns():
        return any(s.name.endswith("feed") and s.level == DiagnosticStatus.WARN and "internal errors" in s.message
                   for d in diags for s in d.status)
    assert spin_until(executor, feed_warns, 10.0)
    pub.close()


def test_close_removes_the_ipc_files_it_bound(ros, tmp_path):
    node, feed_ep, decision_ep = start_bridge(ros, tmp_path)
    files = [tmp_path / "feed", tmp_path / "decisions"]
    assert all(f.exists() for f in files)
    assert node.close()
    assert not any(f.exists() for f in files)
