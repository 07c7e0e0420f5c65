"""ROS 2 launch file: the simulated cobot (tokenspeed_cobot_sim) and the TokenSpeed agent.

`ros2 launch tokenspeed_ros cobot_sim.launch.py` with a full ROS 2 installation; without one,
`tokenspeed_launch cobot_sim` starts the same processes with the same parameter files. Both read
the table in tokenspeed_ros/launch_spec.py. When any node exits, the launch shuts down.
"""
from launch import LaunchDescription
from launch.actions import Shutdown
from launch_ros.actions import Node

from tokenspeed_ros.launch_spec import LAUNCHES, PACKAGE, params_path


def generate_launch_description():
    return LaunchDescription([
        Node(package=PACKAGE, executable=spec.executable, name=spec.name,
             parameters=[str(params_path(spec))], output="screen", on_exit=Shutdown())
        for spec in LAUNCHES["cobot_sim"]
    ])
