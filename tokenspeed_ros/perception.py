"""Camera perception with OpenCV: coloured cube blobs -> table positions in the robot base frame.

Pipeline per image: RGB -> HSV -> one mask per cube colour -> largest connected component ->
pixel centroid -> ray through the pinhole camera -> intersection with the plane of cube centres.
Intrinsics come from sensor_msgs/CameraInfo (K; lens distortion is ignored: feed rectified
images); the camera pose from a geometry_msgs/PoseStamped of the optical frame in the robot base
frame (the simulator publishes it latched on camera/pose).
"""
from __future__ import annotations

from dataclasses import dataclass

import cv2
import numpy as np

from tokenspeed_ros.inputs import BadInput

# OpenCV HSV: hue 0..179 (degrees / 2), saturation and value 0..255.
CUBE_HUES = {"red_cube": [(0, 8), (170, 179)], "green_cube": [(45, 85)], "blue_cube": [(100, 130)]}
MIN_SATURATION = 100
MIN_VALUE = 40


def quaternion_matrix(q) -> np.ndarray:
    """Unit quaternion (x, y, z, w) -> rotation matrix [3, 3]."""
    x, y, z, w = q
    return np.array([
        [1 - 2 * (y * y + z * z), 2 * (x * y - z * w), 2 * (x * z + y * w)],
        [2 * (x * y + z * w), 1 - 2 * (x * x + z * z), 2 * (y * z - x * w)],
        [2 * (x * z - y * w), 2 * (y * z + x * w), 1 - 2 * (x * x + y * y)],
    ])


@dataclass(frozen=True)
class CameraModel:
    """Pinhole camera: K [3, 3] (pixels), optical frame rotation R [3, 3] (columns: x right,
    y down, z forward, in the base frame) and position [3] (metres), image size in pixels."""

    K: np.ndarray
    R: np.ndarray
    position: np.ndarray
    width: int
    height: int

    @classmethod
    def from_msgs(cls, info, pose) -> "CameraModel":
        """Build from sensor_msgs/CameraInfo (K, image size) and geometry_msgs/Pose of the optical
        frame (REP 103: x right, y down, z forward) in the robot base frame.

        Raises BadInput "camera_info_invalid" (non-finite or non-positive focal lengths, zero
        image size) or "camera_pose_invalid" (non-finite values, quaternion not of unit length).
        """
        K = np.array(info.k, dtype=float).reshape(3, 3)
        if not np.all(np.isfinite(K)) or K[0, 0] <= 0 or K[1, 1] <= 0 or info.width == 0 or info.height == 0:
            raise BadInput("camera_info_invalid", f"K={K.ravel().tolist()} size={info.width}x{info.height}")
        q = np.array([pose.orientation.x, pose.orientation.y, pose.orientation.z, pose.orientation.w])
        t = np.array([pose.position.x, pose.position.y, pose.position.z])
        if not (np.all(np.isfinite(q)) and np.all(np.isfinite(t)) and abs(np.linalg.norm(q) - 1.0) < 1e-3):
            raise BadInput("camera_pose_invalid", f"position {t.tolist()} quaternion {q.tolist()}")
        return cls(K=K, R=quaternion_matrix(q), position=t, width=int(info.width), height=int(info.height))

    def project(self, point) -> tuple[float, float]:
        """Base-frame point [3] (metres) -> pixel (u, v); (0, 0) is the top-left pixel's centre."""
        pc = self.R.T @ (np.asarray(point, float) - self.position)
        uvw = self.K @ pc
        return float(uvw[0] / uvw[2]), float(uvw[1] / uvw[2])

    def pixel_to_plane(self, u: float, v: float, plane_z: float) -> tuple[float, float] | None:
        """Pixel (u, v) -> (x, y) in metres where its ray meets the plane z = plane_z, or None
        when the ray does not reach the plane in front of the camera."""
        ray = self.R @ np.linalg.solve(self.K, [u, v, 1.0])
        if abs(ray[2]) < 1e-12:
            return None
        t = (plane_z - self.position[2]) / ray[2]
        if t <= 0:
            return None
        p = self.position + t * ray
        return float(p[0]), float(p[1])


class CameraRig:
    """The camera's intrinsics (CameraInfo) and pose (PoseStamped), and the `CameraModel` made
    when both are valid; a bad message leaves the last valid pair in place."""

    def __init__(self):
        self.info = None
        self.pose = None
        self.model: CameraModel | None = None

    def on_info(self, info) -> None:
        """A CameraInfo (a repeat of the same intrinsics changes nothing). Raises BadInput."""
        old = self.info
        if old is None or (list(old.k), old.width, old.height) != (list(info.k), info.width, info.height):
            self._update(info, self.pose)

    def on_pose(self, pose) -> None:
        """A PoseStamped of the camera in the base frame. Raises BadInput."""
        self._update(self.info, pose)

    def _update(self, info, pose) -> None:
        model = None if info is None or pose is None else CameraModel.from_msgs(info, pose.pose)
        self.info, self.pose, self.model = info, pose, model

    def locate(self, rgb: np.ndarray, plane_z: float, min_area_px: int, missing: str) -> dict[str, tuple[float, float]]:
        """`locate_cubes` with this camera. Raises BadInput ("no_camera_model": `missing` says
        which topics) before both messages came."""
        if self.model is None:
            raise BadInput("no_camera_model", missing)
        return locate_cubes(rgb, self.model, plane_z, min_area_px)


def find_cubes(rgb: np.ndarray, min_area_px: int) -> dict[str, tuple[float, float, int]]:
    """Colour blobs in an RGB uint8 image [H, W, 3] -> {cube name: (u, v, area_px)} for the
    largest blob of each cube colour with at least `min_area_px` pixels."""
    hsv = cv2.cvtColor(rgb, cv2.COLOR_RGB2HSV)
    found = {}
    for name, ranges in CUBE_HUES.items():
        mask = np.zeros(hsv.shape[:2], np.uint8)
        for lo, hi in ranges:
            mask |= cv2.inRange(hsv, (lo, MIN_SATURATION, MIN_VALUE), (hi, 255, 255))
        n, _, stats, centroids = cv2.connectedComponentsWithStats(mask, connectivity=8)
        if n < 2:
            continue
        best = 1 + int(np.argmax(stats[1:, cv2.CC_STAT_AREA]))
        area = int(stats[best, cv2.CC_STAT_AREA])
        if area >= min_area_px:
            found[name] = (float(centroids[best][0]), float(centroids[best][1]), area)
    return found


def locate_cubes(rgb: np.ndarray, camera: CameraModel, plane_z: float, min_area_px: int) -> dict[str, tuple[float, float]]:
    """RGB image [H, W, 3] uint8 -> {cube name: (x, y)} on the plane z = plane_z (metres).

    Raises BadInput "image_size" when the image size differs from the camera model's.
    """
    if rgb.shape[:2] != (camera.height, camera.width):
        raise BadInput("image_size", f"image {rgb.shape[1]}x{rgb.shape[0]} but CameraInfo says "
                                     f"{camera.width}x{camera.height}")
    out = {}
    for name, (u, v, _) in find_cubes(rgb, min_area_px).items():
        xy = camera.pixel_to_plane(u, v, plane_z)
        if xy is not None:
            out[name] = xy
    return out


def objects_text(objects: dict[str, tuple[float, float]]) -> str:
    """{name: (x, y)} -> "objects red_cube=(0.42,-0.10) ..." rounded to 1 cm, sorted by name."""
    if not objects:
        return "objects none visible"
    return "objects " + " ".join(f"{n}=({x:.2f},{y:.2f})" for n, (x, y) in sorted(objects.items()))
