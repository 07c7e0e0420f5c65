"""Shared pytest fixtures.

ROS tests talk over real DDS between real processes. Each test gets its own ROS_DOMAIN_ID and
discovery limited to localhost, so concurrent runs on one machine never see each other.
"""
import itertools
import os

import pytest

_domain_ids = itertools.count((os.getpid() * 7) % 100)


@pytest.fixture
def ros_env(monkeypatch):
    """Environment for one ROS test: a fresh ROS_DOMAIN_ID (1..200) and localhost-only discovery.

    Returns the environment dict to pass to child processes (`subprocess.Popen(env=...)`); it is
    also applied to this process, so in-process rclpy nodes join the same domain.
    """
    domain = 1 + next(_domain_ids) % 200
    monkeypatch.setenv("ROS_DOMAIN_ID", str(domain))
    monkeypatch.setenv("ROS_AUTOMATIC_DISCOVERY_RANGE", "LOCALHOST")
    monkeypatch.setenv("PYTHONUNBUFFERED", "1")
    return dict(os.environ)
