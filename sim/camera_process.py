"""Camera rendering in a separate process, so the simulator node's thread stays free.

PyBullet holds Python's GIL while TinyRenderer draws (~30 ms for 320x240 on an idle core of this
machine, 80-120 ms under load), so a render in the node's thread delays every command, joint
state and physics tick behind it; a thread would not help. `CameraProcess` keeps a second
PyBullet world of the same `SceneConfig` in a child process: the node sends a `snapshot()` of
the scene (joint positions and cube poses, a few hundred bytes), the child `restore()`s and
renders it, and the image comes back through a pipe for the node to publish.
"""
from __future__ import annotations

import multiprocessing as mp
import signal

import numpy as np

from tokenspeed_sim.cobot import CobotScene, SceneConfig

_START_TIMEOUT_S = 60.0


def _serve(config: SceneConfig, conn) -> None:
    """Child process (SIGINT ignored: the parent decides when it stops): render each snapshot
    received until None or the pipe closes (either way, also when the parent was killed)."""
    with CobotScene(config) as scene:
        conn.send("ready")
        while True:
            try:
                snapshot = conn.recv()
            except (EOFError, OSError):
                return
            if snapshot is None:
                return
            scene.restore(snapshot)
            try:
                conn.send(scene.render())
            except OSError:                           # the parent is gone (killed): end quietly
                return


class CameraProcess:
    """A child process that renders scene snapshots. One request at a time: `request()` while
    one is in flight raises RuntimeError; `poll()` returns the image once it is ready.
    Use as a context manager or call `close()`. Raises RuntimeError when the child cannot start."""

    def __init__(self, config: SceneConfig):
        ctx = mp.get_context("spawn")                 # no fork of a process that runs DDS threads
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(config, child), daemon=True, name="tokenspeed_sim_camera")
        self.busy = False
        # the child starts with SIGINT ignored (inherited across its exec), so a Ctrl-C to the
        # process group during its bootstrap imports is not a KeyboardInterrupt traceback there
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            self._proc.start()
        finally:
            signal.signal(signal.SIGINT, previous)
        child.close()
        try:
            ready = self._conn.poll(_START_TIMEOUT_S) and self._conn.recv() == "ready"
        except EOFError:
            ready = False
        if not ready:
            self.close()
            raise RuntimeError(f"camera process did not start within {_START_TIMEOUT_S:.0f} s "
                               f"(exit code {self._proc.exitcode})")

    def request(self, snapshot: dict) -> None:
        """Start rendering a `CobotScene.snapshot()`; returns at once."""
        if self.busy:
            raise RuntimeError("a render is already in flight")
        self._conn.send(snapshot)
        self.busy = True

    def poll(self, timeout: float = 0.0) -> np.ndarray | None:
        """The rendered image (uint8 [H, W, 3] RGB) if it is ready within `timeout` seconds, else None.
        Raises EOFError when the child died."""
        if not self.busy or not self._conn.poll(timeout):
            return None
        self.busy = False
        return self._conn.recv()

    def close(self) -> None:
        """Stop the child (waits up to 5 s, then kills it). Idempotent."""
        if self._proc.is_alive():
            try:
                if self.busy:   # take the frame in flight, or the child blocks sending it (pipe buffer)
                    self.poll(timeout=5.0)
                self._conn.send(None)
            except (EOFError, OSError):
                pass
            self._proc.join(5.0)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join()
        self._conn.close()

    def __enter__(self) -> "CameraProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
