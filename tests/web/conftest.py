from __future__ import annotations

import pytest

from scripts import build_ui


@pytest.fixture(scope="session", autouse=True)
def built_ui() -> None:
    """The server serves control_plane/ui/: rebuild it, so the tests see web/ as it is now."""
    build_ui.build()
