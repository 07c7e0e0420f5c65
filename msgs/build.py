"""Build the `tokenspeed_msgs` interface package with plain CMake and install it into a venv.

Usage (the Makefile's `setup` runs this):  .venv/bin/python msgs/build.py [--build-dir build/msgs]

The ROS 2 wheels ship exported CMake targets that name the wheel builder's interpreter paths
(`/opt/python/cp311-cp311/include/python3.11` and that interpreter's numpy include dir). Before
configuring, every `<venv>/share/**/*.cmake` file is rewritten to name this interpreter's own
include dir (`sysconfig.get_paths()['include']`) and `numpy.get_include()` instead; running it
again changes nothing (idempotent). Then `cmake` configures, builds and installs the package with
`CMAKE_INSTALL_PREFIX=<venv>`, so `from tokenspeed_msgs.msg import ActionCommand` works in the
venv's Python with nothing to source. Takes ~40 s on 2 cores. CMake is the venv's own (the `cmake`
wheel of the `msgs-build` extra) where it has one, else the one on PATH; the generated C/C++ needs
a compiler (`cc`/`c++`).

The venv is the one this script runs in (`sys.prefix`). Raises SystemExit with cmake's exit
status when a step fails.
"""
import argparse
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy

HERE = Path(__file__).resolve().parent

# A foreign interpreter's Python include dir and its numpy include dir, as the wheel builder
# wrote them into INTERFACE_INCLUDE_DIRECTORIES (one `;`-separated list per target).
_PY_INCLUDE = re.compile(r'[^\s";]*/include/python3\.\d+t?(?=[\s";])')
_NUMPY_INCLUDE = re.compile(r'[^\s";]*/site-packages/numpy/(?:_core|core)/include(?=[\s";])')


def repoint_cmake_files(prefix: Path) -> int:
    """Rewrite foreign Python/numpy include paths in `prefix/share/**/*.cmake` to this interpreter's.

    Returns the number of files changed (0 on a second run).
    """
    py_include = sysconfig.get_paths()["include"]
    np_include = numpy.get_include()
    changed = 0
    for path in sorted((prefix / "share").glob("**/*.cmake")):
        text = path.read_text()
        new = _NUMPY_INCLUDE.sub(lambda _: np_include, _PY_INCLUDE.sub(lambda _: py_include, text))
        if new != text:
            path.write_text(new)
            changed += 1
    return changed


def _run(cmd: list[str]) -> None:
    print("+", " ".join(cmd), flush=True)
    result = subprocess.run(cmd)
    if result.returncode:
        raise SystemExit(result.returncode)


def main(argv: list[str] | None = None) -> None:
    """Repoint the wheels' CMake files, then configure, build and install `msgs/` into the venv."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--build-dir", type=Path, default=HERE.parent / "build" / "msgs")
    parser.add_argument("--jobs", type=int, default=2)
    args = parser.parse_args(argv)

    prefix = Path(sys.prefix)
    cmake = str(prefix / "bin" / "cmake") if (prefix / "bin" / "cmake").exists() else shutil.which("cmake")
    if cmake is None:
        raise SystemExit("msgs/build.py: no cmake (install the msgs-build extra, or cmake >= 3.22 on PATH)")
    print(f"repointed {repoint_cmake_files(prefix)} CMake files to {sys.executable}'s includes")
    env_prefix = str(prefix)
    os.environ["AMENT_PREFIX_PATH"] = env_prefix
    _run([
        cmake, "-S", str(HERE), "-B", str(args.build_dir),
        f"-DCMAKE_PREFIX_PATH={env_prefix}", f"-DCMAKE_INSTALL_PREFIX={env_prefix}",
        "-DBUILD_TESTING=OFF", f"-DPython3_EXECUTABLE={prefix / 'bin' / 'python3'}",
    ])
    _run([cmake, "--build", str(args.build_dir), "-j", str(args.jobs)])
    _run([cmake, "--install", str(args.build_dir)])


if __name__ == "__main__":
    main()
