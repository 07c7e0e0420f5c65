"""The PyBullet cobot scene: it builds and renders what the ground truth says, executes the
robot tools with IK, checks the scenario, and rejects bad commands without moving."""
import json
import math
import subprocess
import sys
import time

import numpy as np
import pytest

from tokenspeed_ros.perception import CameraModel, quaternion_matrix
from tokenspeed_sim.cobot import CUBE_HALF, CUBES, WORKSPACE_X, WORKSPACE_Y, CobotScene, CommandRejected, SceneConfig


def run_until_done(scene: CobotScene, tag: int, seconds: float = 8.0) -> list:
    """Step until the command with `tag` reports done (or `seconds` of sim time pass)."""
    events = []
    for _ in range(int(seconds / scene.config.time_step)):
        events += scene.step()
        if any(e.tag == tag and e.state == "done" for e in events):
            break
    return events


@pytest.fixture
def scene():
    with CobotScene(SceneConfig(seed=3)) as s:
        s.step(24)
        yield s


def test_scene_is_seeded_and_inside_the_workspace():
    with CobotScene(SceneConfig(seed=11)) as a, CobotScene(SceneConfig(seed=11)) as b, \
            CobotScene(SceneConfig(seed=12)) as c:
        assert a.object_positions() == b.object_positions()
        assert a.object_positions() != c.object_positions()
        points = [xyz[:2] for xyz in a.object_positions().values()] + [a.target_xy]
        for x, y in points:
            assert WORKSPACE_X[0] <= x <= WORKSPACE_X[1] and WORKSPACE_Y[0] <= y <= WORKSPACE_Y[1]
        assert min(math.dist(p, q) for i, p in enumerate(points) for q in points[i + 1:]) > 0.1
        assert "x=%.2f" % a.target_xy[0] in a.goal_text()


def test_camera_sees_each_cube_where_ground_truth_says(scene):
    """The agent's pinhole model (tokenspeed_ros.perception) built from the camera the sim
    publishes (K, optical-frame pose) finds each cube's colour where the ground truth puts it."""
    img = scene.render()
    assert img.shape == (240, 320, 3) and img.dtype == np.uint8
    position, quat = scene.camera_pose()
    model = CameraModel(K=scene.camera_matrix, R=quaternion_matrix(np.array(quat)), position=position,
                        width=320, height=240)
    for name, xyz in scene.object_positions().items():
        u, v = model.project(xyz)
        assert 0 <= u < 320 and 0 <= v < 240
        patch = img[int(round(v)) - 1:int(round(v)) + 2, int(round(u)) - 1:int(round(u)) + 2].reshape(-1, 3)
        channel = int(np.argmax(CUBES[name]))            # the cube's dominant colour channel
        others = [c for c in range(3) if c != channel]
        assert (patch[:, channel] > 80).all() and (patch[:, channel] > 2 * patch[:, others].max(axis=1)).all(), \
            f"{name} not visible at pixel ({u:.0f}, {v:.0f}): {patch.tolist()}"
    # the camera pose is a proper rotation and K maps the optical axis to the image centre
    r = scene.camera_rotation
    assert np.allclose(r.T @ r, np.eye(3), atol=1e-9) and np.isclose(np.linalg.det(r), 1.0)
    u, v = model.project(np.array(scene.config.camera_target))
    assert abs(u - 159.5) < 1e-6 and abs(v - 119.5) < 1e-6


def test_pick_and_place_reaches_the_goal(scene):
    assert not scene.scenario_status()["success"]
    events = scene.execute("pick", {"object": "red_cube"}, tag=1)
    events += run_until_done(scene, 1)
    assert [(e.state, e.detail) for e in events] == [("applied", 'executing pick {"object": "red_cube"}'),
                                                    ("done", "ok")]
    assert scene.held == "red_cube"
    assert scene.object_positions()["red_cube"][2] > 0.15          # lifted off the table
    x, y = scene.target_xy
    events = scene.execute("place", json.dumps({"x": x, "y": y}), tag=2)   # JSON text works too
    assert [e.state for e in events + run_until_done(scene, 2)] == ["applied", "done"]
    scene.step(60)
    status = scene.scenario_status()
    assert status["success"], status
    assert status["holding"] is None and status["distance_m"] < 0.02
    assert abs(status["objects"]["red_cube"][2] - CUBE_HALF) < 0.005


def test_move_to_then_hold_preempts_and_freezes(scene):
    scene.execute("move_to", {"x": 0.5, "y": 0.2, "z": 0.3}, tag=5)
    events = run_until_done(scene, 5)
    assert events[-1].state == "done" and events[-1].detail == "ok"
    assert np.linalg.norm(scene.gripper_position() - [0.5, 0.2, 0.3]) < 0.01
    scene.execute("move_to", {"x": 0.4, "y": -0.2, "z": 0.1}, tag=6)
    scene.step(60)
    events = scene.execute("hold", {}, tag=7)
    assert [(e.tag, e.state) for e in events] == [(6, "preempted"), (7, "applied"), (7, "done")]
    frozen = scene.gripper_position()
    scene.step(240)
    assert np.linalg.norm(scene.gripper_position() - frozen) < 0.01
    assert not scene.busy


def test_repeating_the_running_command_continues_it(scene):
    scene.execute("move_to", {"x": 0.5, "y": 0.0, "z": 0.3}, tag=1)
    scene.step(10)
    events = scene.execute("move_to", {"x": 0.5, "y": 0.0, "z": 0.3}, tag=2)
    events += run_until_done(scene, 2)
    assert [(e.tag, e.state) for e in events] == [(2, "applied"), (1, "done"), (2, "done")]
    assert events[0].detail == "continues decision 1"


@pytest.mark.parametrize("tool, args, reason", [
    ("fly", {}, "unknown tool 'fly'"),
    ("pick", "{not json", "not valid JSON"),
    ("pick", "[1, 2]", "must be a JSON object"),
    ("pick", "[" * 100_000, "not valid JSON"),
    ("pick", {"object": "purple_cube"}, "is not one of"),
    ("pick", {}, "'object' is a required property"),
    ("place", {"x": 0.9, "y": 0.0}, "x: 0.9 is greater than the maximum of 0.7"),
    ("move_to", {"x": 0.5, "y": 0.0, "z": "high"}, "z: 'high' is not of type 'number'"),
    ("move_to", {"x": 0.5, "y": 0.0, "z": 0.2, "speed": 3}, "Additional properties"),
    ("move_to", {"x": float("nan"), "y": 0.0, "z": 0.2}, "x is not a finite number"),
    ("place", {"x": 0.5, "y": 0.0}, "not holding a cube"),
])
def test_invalid_commands_are_rejected_and_change_nothing(scene, tool, args, reason):
    before = scene.joint_state()[1]
    with pytest.raises(CommandRejected, match=reason.replace("(", r"\(")):
        scene.execute(tool, args, tag=9)
    assert scene.step(120) == [] and not scene.busy
    assert np.allclose(scene.joint_state()[1][:7], before[:7], atol=1e-3)
    assert scene.scenario_status()["commands_rejected"] == 1


def test_reset_starts_a_new_task_in_the_same_world(scene):
    """reset() preempts the executing command, sends the arm home and lays out the scene of the
    new seed, with the goal for the new target cube; a bad target changes nothing."""
    scene.execute("pick", {"object": "red_cube"}, tag=7)
    scene.step(300)
    with pytest.raises(ValueError, match="target_object"):
        scene.reset(seed=4, target_object="yellow_cube")
    assert scene.busy
    events = scene.reset(seed=4, target_object="green_cube")
    assert [(e.tag, e.state, e.detail) for e in events] == [(7, "preempted", "scene reset")]
    assert scene.held is None and not scene.busy
    scene.step(24)
    with CobotScene(SceneConfig(seed=4, target_object="green_cube")) as fresh:
        fresh.step(24)
        for name, xyz in fresh.object_positions().items():
            assert np.allclose(scene.object_positions()[name], xyz, atol=2e-3), name
        assert scene.target_xy == fresh.target_xy and scene.goal_text() == fresh.goal_text()
        assert np.allclose(scene.gripper_position(), fresh.gripper_position(), atol=5e-3)
    status = scene.scenario_status()
    assert not status["busy"] and status["holding"] is None and not status["success"]
    assert "green cube" in status["goal"] and status["commands_accepted"] == 1


def test_bad_config_is_refused():
    with pytest.raises(ValueError, match="target_object"):
        CobotScene(SceneConfig(target_object="yellow_cube"))
    with pytest.raises(ValueError, match="too small"):
        CobotScene(SceneConfig(image_width=4))


def test_camera_process_renders_what_the_scene_shows(scene):
    from tokenspeed_sim.camera_process import CameraProcess

    scene.execute("pick", {"object": "blue_cube"})
    scene.step(500)                                             # arm moved, cube lifted
    with CameraProcess(scene.config) as camera:
        assert camera.poll() is None and not camera.busy
        camera.request(scene.snapshot())
        with pytest.raises(RuntimeError, match="in flight"):
            camera.request(scene.snapshot())
        image = camera.poll(timeout=30)
        assert image is not None and np.array_equal(image, scene.render())
        scene.reset(seed=5, target_object="green_cube")        # cubes and the target zone move
        camera.request(scene.snapshot())
        image = camera.poll(timeout=30)
        assert image is not None and np.array_equal(image, scene.render())
        camera.request(scene.snapshot())          # closing with a frame in flight must not hang
        t0 = time.monotonic()
    assert time.monotonic() - t0 < 5.0 and not camera._proc.is_alive()


def test_the_simulator_reads_the_engines_tool_files_without_importing_torch():
    """One tool-file reader (`tokenspeed.tools`) for the engine, the nodes and the simulator, and
    importing the simulator's scene module does not import torch."""
    code = ("import sys, tokenspeed.tools, tokenspeed_sim.cobot as c; "
            "assert c.load_tools is tokenspeed.tools.load_tools; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr
