"""ROS 2 launch file: the TokenSpeed market bridge (ZeroMQ market-data feed -> trading agent).

`ros2 launch tokenspeed_ros market.launch.py` with a full ROS 2 installation; without one,
`tokenspeed_launch market` starts the same process with the same parameter file. Both read the
table in tokenspeed_ros/launch_spec.py.
Arguments (`ros2 launch ... name:=value`): params_file, model, autostart, namespace, use_sim_time, log_level
(launch_spec.LAUNCH_ARGUMENTS). Feed publishers (`tokenspeed_market_replay`, cryptofeed)
connect to the bridge's feed endpoint.
"""
from tokenspeed_ros.launch_spec import launch_description


def generate_launch_description():
    return launch_description("market")
