"""`tokenspeed_launch`: start a launch's processes without `ros2 launch` (not installable here).

Reads the same table as launch/*.launch.py (`launch_spec.LAUNCHES`) and accepts the same launch
arguments (`launch_spec.LAUNCH_ARGUMENTS`: --params-file, --model, --autostart, --namespace,
--use-sim-time, --log-level). Runs each executable as `<exe> --ros-args -r __node:=<name> [-r __ns:=/<namespace>]
--params-file <file> --log-level <level> -p use_sim_time:=<bool> [-p name:=value ...]`; each
child runs in its own process group. Managed (lifecycle) nodes start with autostart false and
the launcher drives them, like a lifecycle manager: configure (the model loads), activate; at the
end deactivate (their safe fallback goes out) before they are stopped. With `--autostart false`
it leaves them unconfigured for another lifecycle manager. The launch ends when any
child exits or a configure fails, after `--duration` seconds, or on Ctrl-C / SIGTERM; then every
child's group gets SIGINT, and after `--grace` seconds SIGTERM, then SIGKILL, so no process is
left behind.

Examples:
    tokenspeed_launch cobot_sim --duration 60
    tokenspeed_launch cobot_sim --namespace cell1 --model tiny-random
    tokenspeed_launch agent --set tokenspeed_agent.model=tiny-random --set tokenspeed_agent.fallback=stop
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tokenspeed_ros.launch_spec import LAUNCH_ARGUMENTS, LAUNCHES, NodeSpec, dds_profile_env, params_path

POLL_S = 0.1
SERVICE_POLL_S = 0.02   # how often a transition looks whether the node's lifecycle service is discovered yet
CONFIGURE_TIMEOUT_S = 900.0     # a first model load converts the weights (minutes on 2 cores)


def resolve_executable(name: str) -> str:
    """Path of a console entry point: next to this Python first (the venv), then on PATH.

    Raises FileNotFoundError naming the executable.
    """
    local = Path(sys.executable).parent / name
    if local.exists():
        return str(local)
    found = shutil.which(name)
    if found is None:
        raise FileNotFoundError(f"executable {name!r} not found next to {sys.executable} or on PATH")
    return found


@dataclass(frozen=True)
class LaunchArgs:
    """Values of the launch arguments (see launch_spec.LAUNCH_ARGUMENTS); '' = not given."""

    params_file: str = ""
    model: str = ""
    autostart: str = "true"
    namespace: str = ""
    use_sim_time: str = "false"
    log_level: str = "info"


def command(spec: NodeSpec, overrides: list[str], args: LaunchArgs = LaunchArgs()) -> list[str]:
    """Command line for one node; `overrides` are "name:=value" parameter overrides (last, so
    they win)."""
    params = args.params_file if spec.managed and args.params_file else str(params_path(spec))
    cmd = [resolve_executable(spec.executable), "--ros-args", "-r", f"__node:={spec.name}"]
    if args.namespace:
        cmd += ["-r", f"__ns:=/{args.namespace.strip('/')}"]
    cmd += ["--params-file", params, "--log-level", args.log_level, "-p", f"use_sim_time:={args.use_sim_time}"]
    if spec.managed:
        cmd += ["-p", "autostart:=false"] + (["-p", f"model:={args.model}"] if args.model else [])
    for o in overrides:
        cmd += ["-p", o]
    return cmd


class LifecycleDriver:
    """Drives managed nodes through their lifecycle services (lifecycle_msgs ChangeState), from an
    rclpy node of its own context in this process (no signal handlers of rclpy's)."""

    def __init__(self):
        import rclpy
        from lifecycle_msgs.srv import ChangeState
        from rclpy.executors import SingleThreadedExecutor
        from rclpy.signals import SignalHandlerOptions

        self._ChangeState = ChangeState
        self._ctx = rclpy.Context()
        rclpy.init(context=self._ctx, signal_handler_options=SignalHandlerOptions.NO)
        self._node = rclpy.create_node("tokenspeed_launch", context=self._ctx)
        self._executor = SingleThreadedExecutor(context=self._ctx)
        self._executor.add_node(self._node)

    def transition(self, node: str, label: str, timeout_s: float, abort) -> str:
        """Request transition `label` ("configure", "activate", "deactivate") of `node` (fully
        qualified name); returns "" on success, else why not. Gives up when `abort()` says why."""
        from lifecycle_msgs.msg import Transition

        client = self._node.create_client(self._ChangeState, f"{node}/change_state")
        try:
            request = self._ChangeState.Request(transition=Transition(id=getattr(Transition, f"TRANSITION_{label.upper()}")))
            end = time.monotonic() + timeout_s
            future = None
            while time.monotonic() < end:
                why = abort()
                if why:
                    return why
                if future is None and client.service_is_ready():
                    future = client.call_async(request)
                if future is not None and future.done():
                    return "" if future.result().success else f"{node}: {label} failed (see its log)"
                self._executor.spin_once(timeout_sec=POLL_S if future is not None else SERVICE_POLL_S)
            return f"{node}: no answer to {label} within {timeout_s:g} s"
        finally:
            self._node.destroy_client(client)

    def close(self) -> None:
        self._executor.shutdown()
        self._node.destroy_node()
        self._ctx.try_shutdown()


def parse_overrides(items: list[str], specs: tuple[NodeSpec, ...]) -> dict[str, list[str]]:
    """["node.param=value", ...] -> {node name: ["param:=value", ...]}. Raises ValueError."""
    names = {s.name for s in specs}
    out: dict[str, list[str]] = {n: [] for n in names}
    for item in items:
        node, dot, rest = item.partition(".")
        param, eq, value = rest.partition("=")
        if not dot or not eq or not param or node not in names:
            raise ValueError(f"--set {item!r}: expected NODE.PARAM=VALUE with NODE one of {sorted(names)}")
        out[node].append(f"{param}:={value}")
    return out


def stop_all(procs: list[subprocess.Popen], grace_s: float) -> None:
    """SIGINT every child's process group, then SIGTERM and SIGKILL after `grace_s` seconds each."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGKILL):
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, sig)
                except ProcessLookupError:
                    pass
        end = time.monotonic() + grace_s
        while time.monotonic() < end and any(p.poll() is None for p in procs):
            time.sleep(POLL_S)
        if all(p.poll() is not None for p in procs):
            break
    for p in procs:
        p.wait()
        try:   # grandchildren that outlived their parent are still in its group
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def run(launch: str, *, duration_s: float | None = None, overrides: list[str] = (), grace_s: float = 5.0,
        args: LaunchArgs = LaunchArgs()) -> int:
    """Run a launch until a child exits, a managed node fails to configure, `duration_s` passes
    or a signal arrives. Its processes (this one included) get the package's Fast DDS discovery
    profile unless the environment names one (`launch_spec.dds_profile_env`).

    Returns 0 when every child exited with 0 (or was stopped by the launcher and exited
    cleanly), 1 when a managed node could not be brought up, else the first non-zero exit status.
    Raises KeyError for an unknown launch, ValueError for bad overrides, FileNotFoundError for a
    missing executable.
    """
    specs = LAUNCHES[launch]
    dds_profile_env(os.environ)     # the children's and this process's participants (the lifecycle driver)
    per_node = parse_overrides(list(overrides), specs)
    cmds = [command(s, per_node[s.name], args) for s in specs]
    ns = f"/{args.namespace.strip('/')}" if args.namespace.strip("/") else ""
    managed = [f"{ns}/{s.name}" for s in specs if s.managed]
    stop = {"why": ""}

    def on_signal(signum, _frame):
        stop["why"] = signal.Signals(signum).name

    def abort() -> str:
        exited = [(s, p) for s, p in zip(specs, procs) if p.poll() is not None]
        if exited and not stop["why"]:
            stop["why"] = f"{exited[0][0].name} exited with status {exited[0][1].returncode}"
        return stop["why"]

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    procs: list[subprocess.Popen] = []
    driver = None
    brought_up = bring_up_failed = False
    try:
        for spec, cmd in zip(specs, cmds):
            procs.append(subprocess.Popen(cmd, start_new_session=True))
            print(f"[tokenspeed_launch] {spec.name} (pid {procs[-1].pid}): {' '.join(cmd)}", flush=True)
        # after the children: rclpy's import and init here overlap their start
        driver = LifecycleDriver() if managed else None
        end = None if duration_s is None else time.monotonic() + duration_s
        for node in managed if args.autostart == "true" else []:
            for label in ("configure", "activate"):
                why = driver.transition(node, label, CONFIGURE_TIMEOUT_S, abort)
                if why:
                    bring_up_failed = not stop["why"]
                    stop["why"] = stop["why"] or why
                    break
                print(f"[tokenspeed_launch] {node}: {label}d", flush=True)
        brought_up = not stop["why"]
        while not stop["why"]:
            if abort():
                break
            if end is not None and time.monotonic() >= end:
                stop["why"] = f"duration {duration_s} s reached"
            else:
                time.sleep(POLL_S)
        print(f"[tokenspeed_launch] stopping: {stop['why']}", flush=True)
        if brought_up:      # the safe fallback goes out while the nodes still run
            for node in managed:
                driver.transition(node, "deactivate", 5.0, lambda: "")
    finally:
        running_at_stop = {p.pid for p in procs if p.poll() is None}
        stop_all(procs, grace_s)
        if driver is not None:
            driver.close()
        for s, h in old.items():
            signal.signal(s, h)
    failed = [1] if bring_up_failed else []
    for spec, p in zip(specs, procs):
        print(f"[tokenspeed_launch] {spec.name} exit status {p.returncode}", flush=True)
        clean = p.returncode == 0 or (p.pid in running_at_stop and p.returncode == -signal.SIGINT)
        if not clean:
            failed.append(p.returncode if p.returncode > 0 else 128 - p.returncode)
    return failed[0] if failed else 0


def main(argv: list[str] | None = None) -> int:
    """Console entry point `tokenspeed_launch`."""
    parser = argparse.ArgumentParser(prog="tokenspeed_launch", description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.partition("\n")[2].strip())
    parser.add_argument("launch", choices=sorted(LAUNCHES), help="which launch (as launch/<name>.launch.py)")
    for name, default, text in LAUNCH_ARGUMENTS:
        parser.add_argument("--" + name.replace("_", "-"), default=default, help=f"{text} (default {default!r})")
    parser.add_argument("--duration", type=float, default=None, help="stop after this many seconds")
    parser.add_argument("--set", action="append", default=[], metavar="NODE.PARAM=VALUE",
                        help="parameter override for one node (repeatable)")
    parser.add_argument("--grace", type=float, default=5.0, help="seconds between SIGINT, SIGTERM and SIGKILL")
    parser.add_argument("--dry-run", action="store_true", help="print the command lines and exit")
    args = parser.parse_args(argv)
    launch_args = LaunchArgs(**{name: getattr(args, name) for name, _, _ in LAUNCH_ARGUMENTS})
    for name in ("use_sim_time", "autostart"):
        if getattr(launch_args, name) not in ("true", "false"):
            parser.error(f"--{name.replace('_', '-')} must be true or false")
    try:
        specs = LAUNCHES[args.launch]
        per_node = parse_overrides(args.set, specs)
        if args.dry_run:
            for s in specs:
                print(" ".join(command(s, per_node[s.name], launch_args)))
            return 0
        return run(args.launch, duration_s=args.duration, overrides=args.set, grace_s=args.grace, args=launch_args)
    except (ValueError, FileNotFoundError) as e:
        print(f"tokenspeed_launch: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
