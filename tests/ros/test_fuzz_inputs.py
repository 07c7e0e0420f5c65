"""Fuzzing with Hypothesis (derandomized: the same examples every run): market records as they
arrive on ZeroMQ, and the fields of the ROS messages the agent reads. Whatever arrives, the
parser either accepts it with plausible values or refuses it with its own error and a counted
kind; it never raises anything else. The default suite runs a bounded number of examples, the
slow suite many more (and the records over a real ZeroMQ socket into the bridge)."""
import json
import math
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sensor_msgs.msg import CameraInfo, Image, JointState

from tokenspeed_ros.inputs import BadInput, image_to_rgb, joint_state_text
from tokenspeed_ros.market_feed import BAD_INPUT_KINDS, FeedLimits, MarketFeed
from tokenspeed_ros.perception import CameraModel

FAST = settings(derandomize=True, max_examples=150, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow])
SLOW = settings(FAST, max_examples=3000)
ACCEPTED = {"trades", "book_snapshots", "book_deltas", "tickers", "resyncs"}

numbers = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True), st.integers(min_value=-(10 ** 400), max_value=10 ** 400),
    st.floats(min_value=99.0, max_value=101.0), st.sampled_from([0, -1, 1e30, 1e-30, "100.5", "nan", "1e999", True]),
    st.text(max_size=8), st.none())
json_values = st.recursive(st.one_of(numbers, st.booleans()),
                           lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                   st.dictionaries(st.text(max_size=6), inner, max_size=4)),
                           max_leaves=12)
levels = st.lists(st.tuples(numbers, numbers).map(list), max_size=6)


@st.composite
def records(draw) -> list[bytes]:
    """One ZeroMQ message: mostly well-shaped cryptofeed records with hostile values, sometimes
    arbitrary bytes."""
    if draw(st.integers(0, 9)) == 0:
        return draw(st.lists(st.binary(max_size=200), min_size=1, max_size=3))
    channel = draw(st.sampled_from(["trades", "book", "ticker", "funding"]))
    # around the local clock: the drawn value is the offset (the same examples every run)
    near_now = st.one_of(st.floats(-5.0, 5.0), st.just(86_400.0)).map(lambda offset: time.time() + offset)
    payload = {"timestamp": draw(st.one_of(numbers, near_now))}
    if channel == "trades":
        payload.update(side=draw(st.sampled_from(["buy", "sell", "hold", 5])), price=draw(numbers),
                       amount=draw(numbers))
    elif channel == "ticker":
        payload.update(bid=draw(numbers), ask=draw(numbers))
    else:
        key = draw(st.sampled_from(["book", "delta", "neither"]))
        sides = {"bid": draw(levels), "ask": draw(levels)}
        if key == "book":
            sides = {side: {str(p): s for p, s in lv if isinstance(p, (int, float))} for side, lv in sides.items()}
        payload[key] = draw(st.one_of(st.just(sides), json_values))
        payload["sequence_number"] = draw(st.one_of(st.integers(-5, 10 ** 30), numbers))
    payload.update(draw(st.dictionaries(st.text(max_size=6), json_values, max_size=2)))
    body = json.dumps(payload, allow_nan=True).encode()
    topic = f"FUZZ-{channel}-BTC-USD".encode()
    return [topic, body] if draw(st.booleans()) else [topic + b" " + body]


def check_feed(feed: MarketFeed, frames: list[bytes]) -> None:
    before = sum(feed.counters.values())
    feed.handle(frames)                         # never raises
    assert sum(feed.counters.values()) >= before + 1 or not frames
    assert set(feed.counters) <= ACCEPTED | set(BAD_INPUT_KINDS), feed.counters
    assert feed.counters["internal_error"] == 0, feed.last_internal_error
    for state in feed.symbols.values():
        assert math.isfinite(state.last_timestamp) and state.last_timestamp <= time.time() + feed.limits.max_future_s
        for side in ("bid", "ask"):
            for price, size in state.book.levels[side].items():
                assert math.isfinite(price) and price > 0 and math.isfinite(size) and 0 < size <= feed.limits.max_size
        for t in state.trades:
            assert math.isfinite(t.price) and t.price > 0 and math.isfinite(t.timestamp)


def check_batch(batch: list[list[bytes]]) -> None:
    """Every record of `batch` into a feed seeded with a small book, checked one by one."""
    feed = MarketFeed(FeedLimits(max_levels=50))
    feed.handle([b"FUZZ-book-BTC-USD " + json.dumps({"timestamp": time.time(), "sequence_number": 1, "book": {
        "bid": {"100.0": 1.0, "99.5": 2.0}, "ask": {"100.5": 1.0}}}).encode()])
    for frames in batch:
        check_feed(feed, frames)


@FAST
@given(st.lists(records(), min_size=1, max_size=8))
def test_market_records(batch):
    check_batch(batch)


@pytest.mark.slow
@SLOW
@given(st.lists(records(), min_size=1, max_size=20))
def test_market_records_many(batch):
    check_batch(batch)


finite_or_not = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.floats(-4.0, 4.0))


@FAST
@given(names=st.lists(st.text(max_size=5), max_size=12), positions=st.lists(finite_or_not, max_size=80))
def test_joint_state_fields(names, positions):
    try:
        text = joint_state_text(JointState(name=names, position=positions))
    except BadInput as e:
        assert e.kind.startswith("joint_")
        return
    assert text.startswith("joints q=[") and "nan" not in text and "inf" not in text


@FAST
@given(encoding=st.sampled_from(["rgb8", "bgr8", "mono8", "", "rgb8\x00"]), width=st.integers(0, 5000),
       height=st.integers(0, 5000), step=st.integers(0, 20000), extra=st.integers(-3, 3))
def test_image_fields(encoding, width, height, step, extra):
    size = max(0, min(height * step + extra, 1 << 16))   # a matching length only for small images
    msg = Image(encoding=encoding, width=width, height=height, step=step, data=bytes(size))
    try:
        rgb = image_to_rgb(msg)
    except BadInput as e:
        assert e.kind.startswith("image_")
        return
    assert rgb.shape == (height, width, 3) and width * height <= 1 << 21


@FAST
@given(k=st.lists(finite_or_not, min_size=9, max_size=9), size=st.tuples(st.integers(0, 5000), st.integers(0, 5000)),
       quat=st.lists(finite_or_not, min_size=4, max_size=4), pos=st.lists(finite_or_not, min_size=3, max_size=3))
def test_camera_model_fields(k, size, quat, pos):
    from geometry_msgs.msg import Pose

    pose = Pose()
    pose.position.x, pose.position.y, pose.position.z = pos
    pose.orientation.x, pose.orientation.y, pose.orientation.z, pose.orientation.w = quat
    try:
        CameraModel.from_msgs(CameraInfo(width=size[0], height=size[1], k=k), pose)
    except BadInput as e:
        assert e.kind in ("camera_info_invalid", "camera_pose_invalid")
