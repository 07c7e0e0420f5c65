"""ROS 2 launch file: the TokenSpeed agent node alone (for a real robot or an external simulator).

`ros2 launch tokenspeed_ros agent.launch.py` with a full ROS 2 installation; without one,
`tokenspeed_launch agent` starts the same process with the same parameter file. Both read the
table in tokenspeed_ros/launch_spec.py.
Arguments (`ros2 launch ... name:=value`): params_file, model, autostart, namespace, use_sim_time, log_level
(launch_spec.LAUNCH_ARGUMENTS).
"""
from tokenspeed_ros.launch_spec import launch_description


def generate_launch_description():
    return launch_description("agent")
