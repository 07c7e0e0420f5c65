"""TokenSpeed ROS: the ROS 2 side of TokenSpeed - the agent node (`agent_node`), its deadline
monitor, input checks and perception, the engine thread, and the launch description shared by
the launch files and the `tokenspeed_launch` command."""
