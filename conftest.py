"""Shared pytest fixtures live in tests/fixtures/; they are registered here for every test."""

pytest_plugins = [
    "tests.fixtures.models",
    "tests.fixtures.server",
    "tests.fixtures.controlplane",
]


def pytest_collection_modifyitems(items: list) -> None:  # type: ignore[type-arg]
    """A test that uses the real control plane is marked `controlplane`, whatever its module says, so
    `-m "not controlplane"` (hack/test.sh --quick) leaves out every test that needs the Go-built binaries."""
    import pytest

    for item in items:
        if "control_plane" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.controlplane)
