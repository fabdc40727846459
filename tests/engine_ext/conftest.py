"""Which vLLM these tests run on: named in the session header, and checked
(harness/vllm_release.py).

The extra releases are vLLM's CUDA wheels, so the tests that build engine configurations
run them on vLLM's CPU platform (``VLLM_TARGET_DEVICE=cpu``, set by
scripts/test_vllm_releases.sh). From 0.34 that platform refuses to build a configuration
on an x86 CPU without triton-cpu (its model runner's kernels), which no package here
provides; these tests run no model, so they tell it Triton is there
(``vllm.triton_utils.HAS_TRITON``, read by the platform when it checks a configuration).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from harness.vllm_release import check_expected_vllm, header, imported_vllm


def pytest_report_header(config: pytest.Config) -> str:
    return header()


def pytest_configure(config: pytest.Config) -> None:
    check_expected_vllm()
    if imported_vllm()[0].split("+")[0] == "0.34.0":
        import vllm.triton_utils

        vllm.triton_utils.HAS_TRITON = True


# The root logger's level when these tests began.
_ROOT_LEVEL = logging.getLogger().level


@pytest.fixture(autouse=True)
def _root_logger_level_kept() -> Iterator[None]:
    """vLLM's API app imports a SageMaker package (model_hosting_container_standards) that
    sets the root logger to ERROR when first imported (in a module-scoped fixture, before
    any test's own fixtures); the level is put back after each test, or a later test in this
    process (pytest-xdist runs files of other folders in it) captures no warning."""
    yield
    logging.getLogger().setLevel(_ROOT_LEVEL)
