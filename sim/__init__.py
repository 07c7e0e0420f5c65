"""TokenSpeed simulators: the PyBullet cobot scene and ROS node, market-feed replay, and the
closed-loop latency harness. Never imports `tokenspeed` internals: it is the world the agent acts
in, and talks to the agent only over ROS 2 topics (or ZeroMQ for the market feed).
"""
