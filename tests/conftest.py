"""Suite-wide collection rules.

`hack/test.sh` runs the suite in several pytest-xdist workers (`--dist loadgroup`). Each worker has its own
session: its own control plane, test models and servers, on free ports and in its own temporary folders. The
end-to-end suite is the exception: its session fixture brings up the one real node (kubelet, containerd,
registry, the operator's release) of this machine, so every end-to-end test goes to one worker, in file order.
"""

from __future__ import annotations

from pathlib import Path

import pytest

E2E = Path(__file__).parent / "e2e"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if E2E in Path(item.path).parents:
            item.add_marker(pytest.mark.xdist_group("node"))
