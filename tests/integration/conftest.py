"""The `objects` fixture (tests/fixtures/grporun_objects.py) for every integration test."""

from tests.fixtures.grporun_objects import objects  # noqa: F401  (fixture)
