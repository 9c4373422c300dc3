"""Shared pytest fixtures live in tests/fixtures/; they are registered here for every test."""

pytest_plugins = [
    "tests.fixtures.models",
    "tests.fixtures.server",
    "tests.fixtures.controlplane",
    "tests.fixtures.kueue",
]


def pytest_collection_modifyitems(items: list) -> None:  # type: ignore[type-arg]
    """`controlplane` on every test that uses the real control plane or another server built from the Go module
    proxy (the export tests' OCI registry and S3 gateway), whatever its module says, so `-m "not controlplane"`
    (hack/test.sh --quick) leaves out every test that needs the Go-built binaries.

    No xdist_group mark: with pytest 9, pytest-xdist 3.8's `--dist loadgroup` does not keep a group on one
    worker (it rewrites `item._nodeid`, which pytest 9's `nodeid` no longer reads). hack/test.sh runs the
    end-to-end suite, whose session fixture brings up the one real node, in a pytest process of its own, and
    that fixture refuses to start under several workers.
    """
    import pytest

    go_built = {"control_plane", "oci_registry", "s3_server"}
    for item in items:
        if go_built & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.controlplane)
