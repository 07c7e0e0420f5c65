"""`tokenspeed_market_demo`: replay real Bitstamp order flow into the bridge and a trading agent.

Runs `tokenspeed_market_replay` as a child process publishing the recorded capture over ZeroMQ
(ipc:// sockets in a temporary folder), the `tokenspeed_market_bridge` node in this process
with the agent on the embedded model, and a ZeroMQ SUB on the bridge's decision socket. When
the replay ends it prints tick-to-decision latency percentiles, the deadline hit rate, the
decision outcomes and the bad records the bridge counted and survived.

Example: `tokenspeed_market_demo --duration 120`
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
import rclpy
import zmq
from rclpy.executors import SingleThreadedExecutor
from rclpy.parameter import Parameter

from tokenspeed_ros.launcher import resolve_executable
from tokenspeed_ros.market_bridge import MarketBridgeNode
from tokenspeed_ros.market_feed import BAD_INPUT_KINDS


def _percentiles_ms(samples: list[float]) -> str:
    if not samples:
        return "none"
    p50, p90, p99 = np.percentile(np.asarray(samples) * 1e3, [50, 90, 99])
    return f"p50 {p50:.0f} ms, p90 {p90:.0f} ms, p99 {p99:.0f} ms, max {max(samples) * 1e3:.0f} ms (n={len(samples)})"


def summary(node: MarketBridgeNode, received: int, replay_stats: dict) -> str:
    """Human-readable report of one run (latencies in ms: tick exchange timestamp -> publish)."""
    outcomes = list(node.outcomes)
    model = [o for o in outcomes if o["source"] == "model"]
    orders = [o["feed_to_published_s"] for o in model if o["tool"] == "place_order" and o["feed_to_published_s"] is not None]
    met = sum(o["met"] for o in outcomes)
    reasons = {}
    for o in outcomes:
        reasons[o["reason"]] = reasons.get(o["reason"], 0) + 1
    feed, counts = node.feed.counters, node.counts
    bad = {k: feed[k] for k in BAD_INPUT_KINDS if feed[k]}
    lines = [
        f"feed: {replay_stats.get('sent', 0)} messages sent by the replay, {counts['messages']} received by the bridge "
        f"({feed['book_snapshots']} snapshots, {feed['book_deltas']} deltas, {feed['trades']} trades, "
        f"{feed['tickers']} tickers), {counts['coalesced']} coalesced into batches (largest batch "
        f"{counts['max_batch_seen']}), {feed['resyncs']} book resyncs",
        f"bad input ignored and counted, the bridge still running: {sum(bad.values())} "
        "(one count per bad message, book level or crossed episode; kinds: market_feed.BAD_INPUT_KINDS) " + json.dumps(bad)
        + f"; feed-gap alarms: {feed['feed_gap']} (the replay's end included)",
        "triggers: " + json.dumps({k[8:]: v for k, v in counts.items() if k.startswith("trigger_")})
        + f", {counts['triggers_coalesced']} coalesced before the executor took them; "
        f"{counts['states_streamed']} book states prefilled between decisions",
        f"decisions: {len(outcomes)} published ({received} received over ZeroMQ), {len(model)} by the model, "
        f"{len(outcomes) - len(model)} hold fallbacks; outcomes " + json.dumps(reasons),
        f"deadline hit rate: {met}/{len(outcomes)} = {met / max(1, len(outcomes)):.1%} "
        f"(budget {node.p.deadline_budget_s} s from the tick's exchange timestamp)",
        f"tick-to-decision latency, all decisions: {_percentiles_ms([o['latency_s'] for o in outcomes])}",
        f"tick-to-decision latency, model decisions: {_percentiles_ms([o['latency_s'] for o in model])}",
        f"feed message received -> decision published, model decisions: "
        f"{_percentiles_ms([o['feed_to_published_s'] for o in model if o['feed_to_published_s'] is not None])}; "
        f"orders (place_order): {_percentiles_ms(orders)}",
        f"time to first token, model decisions: {_percentiles_ms([o['ttft_s'] for o in model if o['ttft_s']])}",
        f"engine turn (a streamed prefill still running, the trigger line, decide), late ones included: {_percentiles_ms(list(node.loop.engine_turn_s))}; "
        f"{node.monitor.counts['late_result_dropped']} late model results dropped",
    ]
    for o in model[:3]:
        lines.append(f"  e.g. #{o['decision_id']} {o['trigger']} at mid {o['tick'].get('mid', 0):.2f}: "
                     f"{o['tool']}({json.dumps(o['arguments'])}) in {o['latency_s'] * 1e3:.0f} ms")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Console entry point. Returns 0 after printing the report, 1 if the replay failed, 130 on Ctrl-C."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=float, default=120.0, help="feed seconds to replay")
    ap.add_argument("--start", type=float, default=0.0, help="skip this many feed seconds")
    ap.add_argument("--speed", type=float, default=1.0, help="replay speed (feed s per wall s)")
    ap.add_argument("--model", default="", help='"" = embedded SmolLM2-135M, or a path / "tiny-random"')
    ap.add_argument("--threads", type=int, default=1,
                    help="engine CPU threads; 1 keeps latency steady on a shared CPU, 0 = engine default")
    ap.add_argument("--budget", type=float, default=2.0, help="deadline from the tick timestamp, s")
    ap.add_argument("--move-bps", type=float, default=2.0, help="price-move trigger, basis points")
    ap.add_argument("--timer", type=float, default=5.0, help="timer trigger, s (0 = off)")
    args = ap.parse_args(argv)

    tmp = tempfile.TemporaryDirectory(prefix="tokenspeed-market-")
    feed_ep, decision_ep = f"ipc://{tmp.name}/feed", f"ipc://{tmp.name}/decisions"
    rclpy.init()
    params = {"feed_endpoint": feed_ep, "decision_endpoint": decision_ep, "model": args.model, "threads": args.threads,
              "deadline_budget_s": args.budget, "move_bps": args.move_bps, "timer_s": args.timer}
    node = MarketBridgeNode(parameter_overrides=[Parameter(k, value=v) for k, v in params.items()])
    executor = SingleThreadedExecutor()
    executor.add_node(node)
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(decision_ep)
    received = 0
    replay = None
    code = 0
    try:
        while not node.active:      # autostart: configure (the model load) and activate on the first step
            executor.spin_once(timeout_sec=0.1)
        print(f"engine {node.worker.state}; replaying {args.duration:.0f} s of Bitstamp BTC/USD at "
              f"{args.speed}x", flush=True)
        replay = subprocess.Popen([resolve_executable("tokenspeed_market_replay"), "--endpoint", feed_ep,
                                   "--speed", str(args.speed), "--start", str(args.start),
                                   "--duration", str(args.duration)], stdout=subprocess.PIPE, text=True)
        end = None
        while end is None or time.monotonic() < end:
            executor.spin_once(timeout_sec=0.05)
            while sub.poll(0):
                topic = sub.recv().split(b" ", 1)[0]
                received += topic != b"status"
            if end is None and replay.poll() is not None:
                end = time.monotonic() + args.budget + 1.0  # let open decisions resolve
        out = replay.stdout.read().strip().splitlines()
        if replay.returncode != 0 or not out:
            print(f"tokenspeed_market_demo: replay failed (exit {replay.returncode})", file=sys.stderr)
            code = 1
        else:
            print(summary(node, received, json.loads(out[-1])), flush=True)
    except KeyboardInterrupt:
        code = 130
    finally:
        if replay is not None and replay.poll() is None:
            replay.terminate()
            replay.wait(5)
        sub.close()
        stopped = node.close()
        node.destroy_node()
        rclpy.try_shutdown()
        tmp.cleanup()
    if not stopped:  # the engine thread is mid-forward: skip interpreter finalization
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
