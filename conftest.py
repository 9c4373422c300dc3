"""Shared pytest fixtures live in tests/fixtures/; they are registered here for every test."""

from pathlib import Path

pytest_plugins = [
    "tests.fixtures.models",
    "tests.fixtures.server",
    "tests.fixtures.controlplane",
]

E2E = Path(__file__).parent / "tests" / "e2e"


def pytest_collection_modifyitems(items: list) -> None:  # type: ignore[type-arg]
    """Two marks by what a test needs, whatever its module says:

    - `controlplane` on a test that uses the real control plane or another server built from the Go module
      proxy (the export tests' OCI registry and S3 gateway), so `-m "not controlplane"` (hack/test.sh --quick)
      leaves out every test that needs the Go-built binaries;
    - `xdist_group("node")` on every end-to-end test. hack/test.sh runs pytest in several pytest-xdist workers
      (`--dist loadgroup`), each with its own session: its own control plane, models and servers on free
      ports, in its own temporary folders. The end-to-end suite's session fixture brings up the one real node
      of this machine (kubelet, containerd, registry, the operator's release), so its tests share one worker.
    """
    import pytest

    go_built = {"control_plane", "oci_registry", "s3_server"}
    for item in items:
        if go_built & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.controlplane)
        if E2E in Path(item.path).parents:
            item.add_marker(pytest.mark.xdist_group("node"))
