"""Perception, input checks and action mapping on real images and messages: the simulator's
rendered camera and synthetic ones."""
import math

import numpy as np
import pytest
from builtin_interfaces.msg import Time as TimeMsg
from geometry_msgs.msg import Pose
from sensor_msgs.msg import CameraInfo, Image, JointState

from agent_support import CUBE_Z, camera_info, camera_pose, render_cubes
from tokenspeed_ros.inputs import BadInput, check_stamp, image_to_rgb, joint_state_text
from tokenspeed_ros.perception import CameraModel, CameraRig, locate_cubes, objects_text


def test_cubes_located_in_the_simulator_camera_within_a_centimetre():
    from tokenspeed_sim.cobot import CobotScene, SceneConfig

    with CobotScene(SceneConfig(seed=5)) as scene:
        scene.step(120)                                   # let the cubes settle
        rgb = scene.render()
        pos, quat = scene.camera_pose()
        pose = Pose()
        pose.position.x, pose.position.y, pose.position.z = map(float, pos)
        pose.orientation.x, pose.orientation.y, pose.orientation.z, pose.orientation.w = quat
        info = CameraInfo(width=rgb.shape[1], height=rgb.shape[0], k=scene.camera_matrix.ravel().tolist())
        found = locate_cubes(rgb, CameraModel.from_msgs(info, pose), CUBE_Z, min_area_px=12)
        truth = scene.object_positions()
    assert set(found) == set(truth)
    for name, (x, y) in found.items():
        assert math.dist((x, y), truth[name][:2]) < 0.01, name


def test_synthetic_image_round_trip_and_text():
    model = CameraModel.from_msgs(camera_info(), camera_pose().pose)
    found = locate_cubes(render_cubes({"red_cube": (0.55, 0.12), "green_cube": (0.4, -0.2)}), model, CUBE_Z, 12)
    assert set(found) == {"red_cube", "green_cube"}
    assert math.dist(found["red_cube"], (0.55, 0.12)) < 0.005
    assert objects_text(found) == "objects green_cube=(0.40,-0.20) red_cube=(0.55,0.12)"
    assert objects_text({}) == "objects none visible"


def test_image_size_must_match_camera_info():
    model = CameraModel.from_msgs(camera_info(), camera_pose().pose)
    with pytest.raises(BadInput) as e:
        locate_cubes(np.zeros((10, 10, 3), np.uint8), model, CUBE_Z, 12)
    assert e.value.kind == "image_size"


def _image(encoding="rgb8", width=4, height=3, step=None, data=None):
    step = 3 * width if step is None else step
    data = bytes(range(height * step)) if data is None else data
    return Image(width=width, height=height, step=step, encoding=encoding, data=data)


def test_image_conversion_bgr_and_padding():
    rgb = image_to_rgb(_image())
    bgr = image_to_rgb(_image("bgr8"))
    assert rgb.shape == (3, 4, 3) and rgb.dtype == np.uint8
    assert np.array_equal(bgr, rgb[:, :, ::-1])
    padded = image_to_rgb(_image(step=16))                 # rows padded to 16 bytes
    assert padded.shape == (3, 4, 3) and padded[1, 0, 0] == 16


@pytest.mark.parametrize("kwargs, kind", [
    (dict(encoding="mono16"), "image_encoding"),
    (dict(encoding="32FC1"), "image_encoding"),
    (dict(width=0), "image_size"),
    (dict(step=5), "image_size"),
    (dict(data=b"\x00" * 7), "image_corrupt"),
    (dict(width=8000, height=8000, step=24000, data=b""), "image_too_large"),    # held perception 2.8 s
])
def test_bad_images_raise_bad_input(kwargs, kind):
    with pytest.raises(BadInput) as e:
        image_to_rgb(_image(**kwargs))
    assert e.value.kind == kind


def test_joint_text_and_bad_joints():
    assert joint_state_text(JointState(name=["a", "b"], position=[0.004, -0.786])) == "joints q=[0.00,-0.79] (rad)"
    for msg, kind in [(JointState(position=[]), "joint_empty"),
                      (JointState(name=["a"], position=[0.0, 1.0]), "joint_size_mismatch"),
                      (JointState(position=[0.0, float("nan")]), "joint_nonfinite"),
                      (JointState(position=[float("inf")]), "joint_nonfinite"),
                      (JointState(position=[0.0, 1e308]), "joint_out_of_range"),
                      (JointState(position=[0.0] * 10_000), "joint_too_many")]:
        with pytest.raises(BadInput) as e:
            joint_state_text(msg)
        assert e.value.kind == kind


def test_stamp_checks():
    now = 1000.0
    assert check_stamp(TimeMsg(sec=999, nanosec=500_000_000), now, 0.5, 5.0) == 999.5
    for stamp, kind in [(TimeMsg(), "stamp_missing"), (TimeMsg(sec=1002), "stamp_future"), (TimeMsg(sec=900), "stamp_old")]:
        with pytest.raises(BadInput) as e:
            check_stamp(stamp, now, 0.5, 5.0)
        assert e.value.kind == kind


def test_bad_camera_info_and_pose():
    pose = camera_pose().pose
    with pytest.raises(BadInput) as e:
        CameraModel.from_msgs(CameraInfo(width=320, height=240, k=[float("nan")] * 9), pose)
    assert e.value.kind == "camera_info_invalid"
    pose.orientation.w = 3.0
    with pytest.raises(BadInput) as e:
        CameraModel.from_msgs(camera_info(), pose)
    assert e.value.kind == "camera_pose_invalid"


def test_camera_rig_needs_both_messages_and_keeps_the_last_valid_pair():
    rig, rgb = CameraRig(), np.zeros((240, 320, 3), np.uint8)
    with pytest.raises(BadInput) as e:
        rig.locate(rgb, CUBE_Z, 12, "no camera yet")
    assert e.value.kind == "no_camera_model" and "no camera yet" in str(e.value)
    rig.on_info(camera_info())
    assert rig.model is None                            # the pose is still missing
    rig.on_pose(camera_pose())
    good = rig.model
    assert good is not None and rig.locate(rgb, CUBE_Z, 12, "") == {}
    bad = camera_pose()
    bad.pose.orientation.w = 3.0
    with pytest.raises(BadInput):
        rig.on_pose(bad)
    assert rig.model is good                            # a bad message changes nothing


def test_target_pose_of_position_calls():
    from tokenspeed_ros.agent_node import target_pose

    pose = target_pose({"x": 0.5, "y": -0.1, "z": 0.2}, "base", 0.025)
    p, o = pose.pose.position, pose.pose.orientation
    assert pose.header.frame_id == "base" and (p.x, p.y, p.z) == (0.5, -0.1, 0.2)
    assert (o.x, o.y, o.z, o.w) == (1.0, 0.0, 0.0, 0.0)
    assert target_pose({"x": 0.4, "y": 0.0}, "base", 0.025).pose.position.z == 0.025     # place
    assert target_pose({"object": "red_cube"}, "base", 0.025) is None                    # pick
    assert target_pose({}, "base", 0.025) is None                                        # hold
