"""scripts/build_ui.py: the served UI is exactly what the page loads, from web/ and npm."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from scripts import build_ui

ROOT = Path(__file__).resolve().parents[2]
WEB = ROOT / "web"


def _web_copy(tmp_path: Path, *, node_modules: bool = True) -> Path:
    web = tmp_path / "web"
    web.mkdir()
    for name in build_ui.FIRST_PARTY:
        shutil.copyfile(WEB / name, web / name)
    for folder in (build_ui.MODULES_DIR, build_ui.STYLES_DIR):
        shutil.copytree(WEB / folder, web / folder)
    if node_modules:
        (web / "node_modules").symlink_to((WEB / "node_modules").resolve())
    return web


def test_builds_the_pages_files_and_nothing_else(tmp_path: Path) -> None:
    out = tmp_path / "ui"
    (out / "vendor").mkdir(parents=True)
    (out / "vendor" / "left-over.js").write_text("old build")
    files = build_ui.build(_web_copy(tmp_path), out)

    served = {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()}
    assert served == {p.relative_to(out).as_posix() for p in files}
    modules = {p.relative_to(WEB).as_posix() for p in (WEB / "src").rglob("*.js")}
    assert any(m.startswith("src/views/tiers/") for m in modules)
    styles = {p.relative_to(WEB).as_posix() for p in (WEB / "styles").glob("*.css")}
    assert len(styles) > 1
    assert served == {
        *build_ui.FIRST_PARTY,
        *styles,
        *modules,
        *build_ui.THIRD_PARTY.values(),
    }
    refs = build_ui.local_refs((out / "index.html").read_text())
    assert refs and all((out / ref).is_file() for ref in refs)
    for src, dest in build_ui.THIRD_PARTY.items():
        assert (out / dest).read_bytes() == (WEB / "node_modules" / src).read_bytes()


def test_a_page_referring_to_an_unshipped_file_fails_and_leaves_the_old_build(
    tmp_path: Path,
) -> None:
    web = _web_copy(tmp_path)
    out = tmp_path / "ui"
    build_ui.build(web, out)
    before = (out / "index.html").read_text()
    index = web / "index.html"
    index.write_text(
        index.read_text().replace("</body>", '<script src="extra.js"></script></body>')
    )
    with pytest.raises(build_ui.BuildError, match=r"extra\.js"):
        build_ui.build(web, out)
    assert (out / "index.html").read_text() == before


def test_without_node_modules_it_says_to_run_npm_ci(tmp_path: Path) -> None:
    out = tmp_path / "ui"
    with pytest.raises(build_ui.BuildError, match="npm ci"):
        build_ui.build(_web_copy(tmp_path, node_modules=False), out)
    assert not out.exists()


def test_local_refs_skip_urls_and_anchors() -> None:
    html = (
        '<link href="style.css"><script src="vendor/a.js"></script>'
        '<a href="https://example.com/x.js"></a><a href="#top"></a><img src="//cdn/x.png">'
    )
    assert build_ui.local_refs(html) == ["style.css", "vendor/a.js"]


def test_a_module_importing_an_unshipped_file_fails(tmp_path: Path) -> None:
    web = _web_copy(tmp_path)
    (web / "src" / "views" / "extra.js").write_text('import { x } from "../missing.js";\n')
    with pytest.raises(build_ui.BuildError, match=r"missing\.js"):
        build_ui.build(web, tmp_path / "ui")


def test_module_imports() -> None:
    source = (
        'import { a } from "./a.js";\nimport * as b from "../b.js";\nexport { c } from "./c.js";\n'
    )
    assert build_ui.module_imports(source) == ["./a.js", "../b.js", "./c.js"]
