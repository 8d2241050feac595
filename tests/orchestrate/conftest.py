"""The end-to-end jobs here join the session's Ray cluster (`tests/conftest.py: ray_cluster`)."""

import pytest


@pytest.fixture(scope="session", autouse=True)
def _jobs_join_one_ray_cluster(ray_cluster: str | None) -> None:
    """Every test of the package runs after the session's Ray cluster is up."""
