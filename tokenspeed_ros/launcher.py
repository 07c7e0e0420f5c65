"""`tokenspeed_launch`: start a launch's processes without `ros2 launch` (not installable here).

Reads the same table as launch/*.launch.py (`launch_spec.LAUNCHES`) and runs each executable as
`<exe> --ros-args -r __node:=<name> --params-file <config>/<file> [-p name:=value ...]`.
Each child runs in its own process group. The launch ends when any child exits, after
`--duration` seconds, or on Ctrl-C / SIGTERM; then every child's group gets SIGINT, and after
`--grace` seconds SIGTERM, then SIGKILL, so no process is left behind.

Examples:
    tokenspeed_launch cobot_sim --duration 60
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
from pathlib import Path

from tokenspeed_ros.launch_spec import LAUNCHES, NodeSpec, params_path

POLL_S = 0.1


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


def command(spec: NodeSpec, overrides: list[str]) -> list[str]:
    """Command line for one node; `overrides` are "name:=value" parameter overrides."""
    cmd = [resolve_executable(spec.executable), "--ros-args", "-r", f"__node:={spec.name}",
           "--params-file", str(params_path(spec))]
    for o in overrides:
        cmd += ["-p", o]
    return cmd


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


def run(launch: str, *, duration_s: float | None = None, overrides: list[str] = (), grace_s: float = 5.0) -> int:
    """Run a launch until a child exits, `duration_s` passes or a signal arrives.

    Returns 0 when every child exited with 0 (or was stopped by the launcher and exited
    cleanly), else the first non-zero exit status. Raises KeyError for an unknown launch,
    ValueError for bad overrides, FileNotFoundError for a missing executable.
    """
    specs = LAUNCHES[launch]
    per_node = parse_overrides(list(overrides), specs)
    cmds = [command(s, per_node[s.name]) for s in specs]
    stop = {"why": ""}

    def on_signal(signum, _frame):
        stop["why"] = signal.Signals(signum).name

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    procs: list[subprocess.Popen] = []
    try:
        for spec, cmd in zip(specs, cmds):
            procs.append(subprocess.Popen(cmd, start_new_session=True))
            print(f"[tokenspeed_launch] {spec.name} (pid {procs[-1].pid}): {' '.join(cmd)}", flush=True)
        end = None if duration_s is None else time.monotonic() + duration_s
        while not stop["why"]:
            exited = [(s, p) for s, p in zip(specs, procs) if p.poll() is not None]
            if exited:
                stop["why"] = f"{exited[0][0].name} exited with status {exited[0][1].returncode}"
            elif end is not None and time.monotonic() >= end:
                stop["why"] = f"duration {duration_s} s reached"
            else:
                time.sleep(POLL_S)
        print(f"[tokenspeed_launch] stopping: {stop['why']}", flush=True)
    finally:
        running_at_stop = {p.pid for p in procs if p.poll() is None}
        stop_all(procs, grace_s)
        for s, h in old.items():
            signal.signal(s, h)
    failed = []
    for spec, p in zip(specs, procs):
        print(f"[tokenspeed_launch] {spec.name} exit status {p.returncode}", flush=True)
        clean = p.returncode == 0 or (p.pid in running_at_stop and p.returncode == -signal.SIGINT)
        if not clean:
            failed.append(p.returncode if p.returncode > 0 else 128 - p.returncode)
    return failed[0] if failed else 0


def main(argv: list[str] | None = None) -> int:
    """Console entry point `tokenspeed_launch`."""
    parser = argparse.ArgumentParser(prog="tokenspeed_launch", description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("launch", choices=sorted(LAUNCHES), help="which launch (as launch/<name>.launch.py)")
    parser.add_argument("--duration", type=float, default=None, help="stop after this many seconds")
    parser.add_argument("--set", action="append", default=[], metavar="NODE.PARAM=VALUE",
                        help="parameter override for one node (repeatable)")
    parser.add_argument("--grace", type=float, default=5.0, help="seconds between SIGINT, SIGTERM and SIGKILL")
    parser.add_argument("--dry-run", action="store_true", help="print the command lines and exit")
    args = parser.parse_args(argv)
    try:
        specs = LAUNCHES[args.launch]
        per_node = parse_overrides(args.set, specs)
        if args.dry_run:
            for s in specs:
                print(" ".join(command(s, per_node[s.name])))
            return 0
        return run(args.launch, duration_s=args.duration, overrides=args.set, grace_s=args.grace)
    except (ValueError, FileNotFoundError) as e:
        print(f"tokenspeed_launch: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
