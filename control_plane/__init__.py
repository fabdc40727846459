"""The control plane of vllm-output-rate: admin API, UI, migrations and the push endpoint."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("vllm-output-rate")
except PackageNotFoundError:  # imported from a checkout that was never installed
    __version__ = "0+unknown"
