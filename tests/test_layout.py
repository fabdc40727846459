"""Which package stands on which (README, "Layout"): checked on every import statement.

- output_rate_core: pure; imports neither side nor vLLM, SQLAlchemy, FastAPI.
- control_plane (and the migrations): never vLLM nor the engine extension.
- engine_ext: never SQLAlchemy, FastAPI, Alembic nor the control plane.
- harness, tests, bench and scripts are never imported by a shipped package.
- harness and bench never import tests (what both need is in harness); harness never
  imports bench.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NEVER_SHIPPED = {"harness", "tests", "bench", "scripts"}
# package folder -> the top-level modules it may not import
FORBIDDEN = {
    "output_rate_core": {
        "engine_ext",
        "control_plane",
        "vllm",
        "torch",
        "sqlalchemy",
        "alembic",
        "fastapi",
        "starlette",
        "pydantic",
        *NEVER_SHIPPED,
    },
    "control_plane": {"engine_ext", "vllm", "torch", *NEVER_SHIPPED},
    "migrations": {"engine_ext", "vllm", "torch", *NEVER_SHIPPED},
    "engine_ext": {
        "control_plane",
        "sqlalchemy",
        "alembic",
        "fastapi",
        "starlette",
        *NEVER_SHIPPED,
    },
    "harness": {"tests", "bench", "scripts"},
    "bench": {"tests", "scripts"},
}


def imported_modules(path: Path) -> set[str]:
    """Top-level names of every module ``path`` imports (also inside functions)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_a_package_imports_only_what_it_stands_on(package: str) -> None:
    files = sorted((ROOT / package).rglob("*.py"))
    assert files, f"no Python files under {package}/"
    broken = {
        str(path.relative_to(ROOT)): sorted(imported_modules(path) & FORBIDDEN[package])
        for path in files
    }
    assert {path: bad for path, bad in broken.items() if bad} == {}


def test_the_checker_sees_imports_inside_functions(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    import vllm.v1\n    from engine_ext.limiter import X\n")
    assert imported_modules(probe) == {"vllm", "engine_ext"}
