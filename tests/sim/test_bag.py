"""rosbag2 record and replay: `tokenspeed_demo --record` writes a real MCAP bag of the project's
own simulator and agent (tiny random model) over DDS; `tokenspeed_replay` plays its inputs into a
fresh agent process as if live, and the replayed run decides on the same observations."""
import json
import subprocess
import sys

import pytest

from support import BIN, ROOT
from tokenspeed_sim.bag import INPUTS, BagError, read_bag


def test_unreadable_bag_is_a_clear_error(tmp_path):
    with pytest.raises(BagError, match="cannot read bag"):
        read_bag(tmp_path / "missing")
    out = subprocess.run([str(BIN / "tokenspeed_replay"), str(tmp_path / "missing"), "--out", str(tmp_path / "o")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "cannot read bag" in out.stderr


def test_record_a_demo_run_then_replay_it_into_a_new_agent(ros_env, tmp_path):
    bag = tmp_path / "bag"
    rec = subprocess.run([sys.executable, "-m", "tokenspeed_sim.demo", "--duration", "5", "--record", str(bag),
                          "--out", str(tmp_path / "demo"), "--set", "tokenspeed_agent.model=tiny-random"],
                         env=ros_env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert rec.returncode == 0, rec.stdout[-3000:] + rec.stderr[-3000:]
    assert (bag / "metadata.yaml").is_file() and list(bag.glob("*.mcap"))
    topics = {topic for _, topic, _ in read_bag(bag)}
    assert set(INPUTS) | {"agent/action", "agent/observation", "sim/action_feedback"} <= topics

    out = subprocess.run([str(BIN / "tokenspeed_replay"), str(bag), "--model", "tiny-random",
                          "--set", "tokenspeed_agent.tool_choice=hold", "--out", str(tmp_path / "replay")],
                         env=ros_env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    result = json.loads((tmp_path / "replay" / "replay.json").read_text())
    assert result["inputs_replayed"] > 100 and result["replayed"]["model"] >= 1
    assert result["replayed"]["tools"] == {"hold": result["replayed"]["model"]}      # the new setting
    # the replayed agent saw the recorded scenes (perception of the replayed camera images)
    assert result["observed_scenes_replayed"] >= 1
    assert result["observed_scenes_replayed_seen_in_recording"] == result["observed_scenes_replayed"]
