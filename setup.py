"""Builds the admin UI into the package before a wheel or sdist is made (pyproject.toml has
everything else). From a checkout, control_plane/ui/ is rebuilt from web/ and
web/node_modules (scripts/build_ui.py); an sdist has no web/ and ships control_plane/ui/.
"""

from __future__ import annotations

import runpy
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py
from setuptools.command.sdist import sdist

HERE = Path(__file__).resolve().parent


def build_ui() -> None:
    script = HERE / "scripts" / "build_ui.py"
    if (HERE / "web" / "index.html").is_file() and script.is_file():
        runpy.run_path(str(script))["build"]()
    elif not (HERE / "control_plane" / "ui" / "index.html").is_file():
        raise SystemExit("no admin UI: build from a checkout with web/ or from the sdist")


class BuildPyWithUI(build_py):
    def run(self) -> None:
        # Editable installs serve the checkout's control_plane/ui (scripts/setup.sh builds it).
        if not self.editable_mode:
            build_ui()
        super().run()


class SdistWithUI(sdist):
    def run(self) -> None:
        build_ui()
        super().run()


# The design's top level keeps migrations/ beside the packages; it is installed as
# control_plane.migrations (sdist, wheel and editable installs alike).
MIGRATIONS = {"control_plane.migrations": "migrations"}

setup(
    packages=[
        *find_packages(include=["output_rate_core*", "engine_ext*", "control_plane*"]),
        *MIGRATIONS,
    ],
    package_dir=MIGRATIONS,
    cmdclass={"build_py": BuildPyWithUI, "sdist": SdistWithUI},
)
