"""`ros_spin.Spinner`: callbacks rclpy schedules as executor tasks during one spin call run in the
next. The soak spins in 0.5 s chunks; with an executor per chunk, an action result that arrived at
the end of a chunk lost its done callback, the task cycle waited for ever and the cobot loop went
silent (CI, 2026-12-06: 110 s without a decision)."""
from tokenspeed_sim import ros_spin


def test_a_task_scheduled_as_one_spin_call_ends_runs_in_the_next(ros_node):
    ran: list[str] = []
    fired: list[bool] = []

    def on_timer():
        timer.cancel()
        fired.append(True)
        # what a resolved future does with its done callbacks (rclpy.task.Future), e.g. an action result
        ros_node.executor.create_task(lambda: ran.append("done callback"))

    timer = ros_node.create_timer(0.01, on_timer)
    with ros_spin.Spinner(ros_node) as spinner:
        assert spinner.spin(5.0, until=lambda: bool(fired)) == "until"
        assert ran == []                      # queued when the first call returned
        assert spinner.spin(0.5, until=lambda: bool(ran)) == "until"
    assert ran == ["done callback"]


def test_spin_stops_after_its_duration(ros_node):
    with ros_spin.Spinner(ros_node) as spinner:
        assert spinner.spin(0.1) == "duration"
