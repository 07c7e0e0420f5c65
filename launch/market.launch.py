"""ROS 2 launch file: the TokenSpeed market bridge (ZeroMQ market-data feed -> trading agent).

`ros2 launch tokenspeed_ros market.launch.py` with a full ROS 2 installation; without one,
`tokenspeed_launch market` starts the same process with the same parameter file. Both read the
table in tokenspeed_ros/launch_spec.py. Feed publishers (`tokenspeed_market_replay`, cryptofeed)
connect to the bridge's feed endpoint.
"""
from launch import LaunchDescription
from launch_ros.actions import Node

from tokenspeed_ros.launch_spec import LAUNCHES, PACKAGE, params_path


def generate_launch_description():
    return LaunchDescription([
        Node(package=PACKAGE, executable=spec.executable, name=spec.name,
             parameters=[str(params_path(spec))], output="screen")
        for spec in LAUNCHES["market"]
    ])
