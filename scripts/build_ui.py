"""Build the admin UI the control plane serves: web/ sources + uPlot from node_modules.

Writes control_plane/ui/ (git-ignored), which the package ships and `output-rate serve`
serves at /ui/: exactly the files the browser loads, nothing of the npm tree (no
package.json, lock file, type definitions or other builds). The third-party files come
from web/node_modules (`npm ci` in web/, from the npm registry); none are committed.

Run by scripts/setup.sh and by setup.py when a wheel or sdist is built from a checkout.
Standard library only: setup.py runs it inside the build backend.
"""

from __future__ import annotations

import argparse
import posixpath
import re
import shutil
import sys
from pathlib import Path, PurePosixPath

ROOT = Path(__file__).resolve().parents[1]
WEB = ROOT / "web"
OUT = ROOT / "control_plane" / "ui"

# Our own files, copied as they are; plus every ES module under web/src/ and every style
# sheet under web/styles/ (pyproject.toml's package-data lists each of their folders).
FIRST_PARTY = ("index.html", "app.js", "favicon.svg")
MODULES_DIR = "src"
STYLES_DIR = "styles"
# node_modules path -> served path (index.html refers to the served path).
THIRD_PARTY = {
    "uplot/dist/uPlot.min.css": "vendor/uPlot.min.css",
    "uplot/dist/uPlot.iife.min.js": "vendor/uPlot.iife.min.js",
    "uplot/LICENSE": "vendor/uPlot.LICENSE",  # MIT: the notice travels with the copy
}
_IMPORT = re.compile(
    r"""(?:^|[\s;])(?:import|export)\b[^"';]*?from\s*["'](\.{1,2}/[^"']+)["']""", re.M
)
_LOCAL_REF = re.compile(r"""(?:src|href)=["'](?![a-z]+:|//|#)([^"']+)["']""")


class BuildError(Exception):
    pass


def local_refs(html: str) -> list[str]:
    """The local files a page refers to (src=/href=), in order."""
    return _LOCAL_REF.findall(html)


def module_imports(source: str) -> list[str]:
    """The relative modules an ES module imports (`import ... from "./x.js"`)."""
    return _IMPORT.findall(source)


def _unshipped_imports(sources: dict[str, Path]) -> list[str]:
    bad = []
    for served, path in sources.items():
        if not served.endswith(".js") or served.startswith("vendor/"):
            continue
        base = PurePosixPath(served).parent
        for ref in module_imports(path.read_text()):
            target = posixpath.normpath((base / ref).as_posix())
            if target not in sources:
                bad.append(f"{served} imports {ref}")
    return bad


def _under(web: Path, folder: str, pattern: str) -> list[str]:
    return sorted(p.relative_to(web).as_posix() for p in (web / folder).rglob(pattern))


def first_party_files(web: Path = WEB) -> list[str]:
    """Our served files: FIRST_PARTY, the style sheets under web/styles/ and the ES modules
    under web/src/ (served paths)."""
    return [*FIRST_PARTY, *_under(web, STYLES_DIR, "*.css"), *_under(web, MODULES_DIR, "*.js")]


def build(web: Path = WEB, out: Path = OUT) -> list[Path]:
    """Replace `out` with the UI's files; return them. Fails before touching `out`."""
    node_modules = web / "node_modules"
    sources = {name: web / name for name in first_party_files(web)}
    sources.update({served: node_modules / src for src, served in THIRD_PARTY.items()})
    missing = [str(path) for path in sources.values() if not path.is_file()]
    if missing:
        hint = " (run `npm ci` in web/)" if not node_modules.is_dir() else ""
        raise BuildError(f"missing UI sources{hint}: {', '.join(missing)}")
    unknown = [ref for ref in local_refs(sources["index.html"].read_text()) if ref not in sources]
    if unknown:
        raise BuildError(f"web/index.html refers to files the build does not ship: {unknown}")
    broken = _unshipped_imports(sources)
    if broken:
        raise BuildError(f"modules import files the build does not ship: {broken}")

    staging = out.with_name(out.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    for served, source in sources.items():
        target = staging / served
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, target)
    shutil.rmtree(out, ignore_errors=True)
    staging.rename(out)
    return sorted(out / served for served in sources)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--web", type=Path, default=WEB, help="UI sources (with node_modules)")
    parser.add_argument("--out", type=Path, default=OUT, help="where the served files go")
    args = parser.parse_args(argv)
    try:
        files = build(args.web, args.out)
    except BuildError as exc:
        print(f"build_ui: {exc}", file=sys.stderr)
        return 1
    print(f"build_ui: {len(files)} files in {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
