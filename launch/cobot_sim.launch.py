"""ROS 2 launch file: the simulated cobot (tokenspeed_cobot_sim) and the TokenSpeed agent.

`ros2 launch tokenspeed_ros cobot_sim.launch.py` with a full ROS 2 installation; without one,
`tokenspeed_launch cobot_sim` starts the same processes with the same parameter files. Both read
the table in tokenspeed_ros/launch_spec.py.
Arguments (`ros2 launch ... name:=value`): params_file, model, autostart, namespace, use_sim_time, log_level
(launch_spec.LAUNCH_ARGUMENTS). When any node exits, the launch shuts down.
"""
from tokenspeed_ros.launch_spec import launch_description


def generate_launch_description():
    return launch_description("cobot_sim")
