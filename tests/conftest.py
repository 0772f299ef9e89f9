"""Fixtures shared by the multi-process test modules."""

from __future__ import annotations

import pytest

from fault_helpers import Launch


@pytest.fixture
def launches():
    """Launchers started by a test; any still running at the end are killed with their workers."""
    started: list[Launch] = []
    yield started
    for launch in started:
        if launch.proc.poll() is None:
            launch.stop_everything()
