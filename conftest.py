"""Shared pytest fixtures live in tests/fixtures/; they are registered here for every test."""

pytest_plugins = [
    "tests.fixtures.models",
    "tests.fixtures.server",
    "tests.fixtures.controlplane",
]
