"""`tokenspeed_demo`: the closed-loop cobot demo in one command.

Starts the simulator and the agent as separate processes over DDS on localhost with
`tokenspeed_launch cobot_sim` (the same executables and parameter files as
launch/cobot_sim.launch.py; the launcher configures and activates the agent) and listens with the
latency harness in this process: it waits for the agent's engine to load (at most
`--ready-timeout` seconds), sends the simulator's goal to the agent as a RunTask action goal,
measures `--duration` seconds of closed loop, stops the launch (which deactivates the agent and
stops every node) and prints the latency table, the task outcome and the action's result; writes
report.json, latency.png and launch.log (the nodes' output) to `--out`.

Discovery is limited to localhost, the ROS domain is `ROS_DOMAIN_ID` (default 0) and Fast DDS
participants announce themselves every 0.5 s (tokenspeed_ros/config/fastdds.xml, see
`launch_spec.dds_profile_env`) unless the environment says otherwise. Exits 0 when the run
completed and every node exited cleanly.

Examples:
    tokenspeed_demo                         # embedded SmolLM2-135M, 60 s after it loads
    tokenspeed_demo --seed 2                # another scene (cube and target positions)
    tokenspeed_demo --record out/bag        # also record a rosbag2 (MCAP); tokenspeed_replay out/bag
    tokenspeed_demo --duration 30 --set tokenspeed_agent.model=tiny-random
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tokenspeed_ros.launch_spec import dds_profile_env
from tokenspeed_sim.bag import BagError, Recorder
from tokenspeed_sim.harness import listen

STOP_TIMEOUT_S = 30.0     # the launcher's own SIGINT -> SIGTERM -> SIGKILL sequence fits in this


def launch_command(duration_s: float, overrides: list[str], launch: str = "cobot_sim",
                   task_from_action: bool = True) -> list[str]:
    """Command line of the launcher for `launch` (a tokenspeed_launch launch name), running
    `duration_s` seconds with the "NODE.PARAM=VALUE" `overrides`. task_from_action: the agent takes
    its task from the RunTask action only (its goal topic is off)."""
    cmd = [sys.executable, "-m", "tokenspeed_ros.launcher", launch, "--duration", f"{duration_s:g}"]
    if task_from_action:
        cmd += ["--set", "tokenspeed_agent.goal_topic=''"]
    for o in overrides:
        cmd += ["--set", o]
    return cmd


def stop_launch(launcher: subprocess.Popen, timeout_s: float = STOP_TIMEOUT_S) -> int:
    """SIGINT a launcher started with `start_new_session=True` (it deactivates and stops its
    nodes), SIGKILL its group after `timeout_s` seconds; returns its exit status."""
    if launcher.poll() is None:
        launcher.send_signal(signal.SIGINT)
    return wait_launch(launcher, timeout_s)


def wait_launch(launcher: subprocess.Popen, timeout_s: float = STOP_TIMEOUT_S) -> int:
    """Wait `timeout_s` seconds for a launcher already sent SIGINT (a second SIGINT would cut its
    own shutdown short), then SIGKILL its group; returns its exit status."""
    try:
        return launcher.wait(timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(launcher.pid, signal.SIGKILL)
        return launcher.wait()


def run(duration_s: float, out_dir: Path, overrides: list[str], ready_timeout_s: float = 180.0,
        record: Path | None = None) -> int:
    """Run the demo; returns the exit status (0 = clean). record: a new rosbag2 folder (MCAP) to
    record the run's topics into (tokenspeed_sim.bag). Raises OSError when the launcher cannot be
    started, BagError when `record` exists."""
    out_dir.mkdir(parents=True, exist_ok=True)
    env = dds_profile_env(dict(os.environ))      # the launch's processes and the harness: see launch_spec
    env.setdefault("ROS_AUTOMATIC_DISCOVERY_RANGE", "LOCALHOST")
    os.environ.update(env)                       # the harness in this process joins the same domain
    log_path = out_dir / "launch.log"
    print(f"tokenspeed_demo: simulator + agent, {duration_s:g} s once the engine is ready "
          f"(node output: {log_path})", flush=True)
    recorder = Recorder(record) if record is not None else None
    with open(log_path, "w") as log:
        # the launch runs a little longer than the harness so the last decisions are seen applied
        launcher = subprocess.Popen(launch_command(ready_timeout_s + duration_s + 10, overrides), env=env,
                                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            report = listen(duration_s, out_dir, stop=lambda: launcher.poll() is not None, live=True,
                            wait_engine_s=ready_timeout_s, task=True)
        finally:
            rc = stop_launch(launcher)
            if recorder is not None:
                print(f"recorded {record}: {recorder.close()}", flush=True)
    ended_early = report["duration_s"] < duration_s - 1
    log_lines = log_path.read_text().splitlines()
    if ended_early or rc != 0:
        print(f"tokenspeed_demo: the launch {'ended early' if ended_early else 'failed'} (status {rc}); "
              f"{failure_lines(log_lines, log_path)}", flush=True)
    else:
        print("\n".join(line for line in log_lines if line.startswith("[tokenspeed_cobot_sim]") and "renders" in line))
    return rc if rc else (1 if ended_early else 0)


def failure_lines(log_lines: list[str], log_path: Path, n: int = 15) -> str:
    """What to show of launch.log when the launch failed: the launcher's "stopping: <node> exited
    with status N" line and the last `n` lines that name that node (its refusal or error, not the
    other nodes' output as they were stopped after it), else the last `n` lines."""
    stopping = next((line for line in log_lines if "[tokenspeed_launch] stopping:" in line), "")
    node = stopping.split("stopping: ", 1)[1].split(" exited with status")[0] if " exited with status" in stopping else ""
    own = [line for line in log_lines if node and node in line and line != stopping]
    if own:
        return f"{stopping.strip()}; its lines in {log_path}:\n" + "\n".join(own[-n:])
    return f"last lines of {log_path}:\n" + "\n".join(log_lines[-n:])


def main(argv: list[str] | None = None) -> int:
    """Console entry point `tokenspeed_demo`."""
    ap = argparse.ArgumentParser(prog="tokenspeed_demo", description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n", 2)[2])
    ap.add_argument("--duration", type=float, default=60.0,
                    help="seconds of closed loop measured once the engine is ready (default 60)")
    ap.add_argument("--ready-timeout", type=float, default=180.0,
                    help="seconds to wait for the agent's engine to load (default 180)")
    ap.add_argument("--out", type=Path, default=Path("out/demo"), help="folder for report.json, latency.png, launch.log")
    ap.add_argument("--record", type=Path, default=None, metavar="DIR",
                    help="record the run's topics to a new rosbag2 folder (MCAP); replay it with tokenspeed_replay")
    ap.add_argument("--seed", type=int, default=None,
                    help="scene seed of the simulator (cube and target positions; default: its parameter file's)")
    ap.add_argument("--set", action="append", default=[], metavar="NODE.PARAM=VALUE",
                    help="parameter override passed to tokenspeed_launch (repeatable)")
    args = ap.parse_args(argv)
    if args.seed is not None:
        args.set.insert(0, f"tokenspeed_cobot_sim.seed={args.seed}")
    if args.duration <= 0 or args.ready_timeout <= 0:
        ap.error("--duration and --ready-timeout must be > 0")
    t0 = time.monotonic()
    try:
        rc = run(args.duration, args.out, args.set, args.ready_timeout, args.record)
    except BagError as e:
        ap.error(str(e))
    print(f"tokenspeed_demo: done in {time.monotonic() - t0:.0f} s, exit status {rc}", flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
