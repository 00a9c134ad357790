"""MkDocs hooks of the documentation site (mkdocs.yml names this file).

``docs/measurements.md`` shows ``benchmarks/README.md`` itself, so the measurements are written once: a line
``{! benchmarks/README.md !}`` is replaced by that file, its links rewritten to work from the site (links
into ``docs/`` become links between pages; the images it shows are added to the site at the path the
rewritten link names).
"""

from __future__ import annotations

import re
from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parent.parent
_INCLUDE = re.compile(r"^\{!\s*(\S+)\s*!\}\s*$", re.M)
_LINK = re.compile(r"(!?\[[^\]]*\]\()([^)\s#]+)((?:#[^)\s]*)?\))")


def _rewrite(text: str, source: Path) -> str:
    """``text`` of ``source`` (a file outside ``docs/``) with its relative links valid from ``docs/``."""
    def fix(m: re.Match) -> str:
        target = m[2]
        if "://" in target:
            return m[0]
        path = (source.parent / target).resolve()
        try:
            rel = path.relative_to(ROOT / "docs")
        except ValueError:
            rel = Path("_included") / path.relative_to(ROOT)
        return f"{m[1]}{rel.as_posix()}{m[3]}"
    return _LINK.sub(fix, text)


def _included_assets(text: str, source: Path) -> list[Path]:
    """Files outside ``docs/`` that ``source``'s image links show."""
    out = []
    for m in _LINK.finditer(text):
        if m[1].startswith("!") and "://" not in m[2]:
            path = (source.parent / m[2]).resolve()
            if not path.is_relative_to(ROOT / "docs"):
                out.append(path)
    return out


def _includes(config) -> list[Path]:
    docs = Path(config["docs_dir"])
    found = []
    for page in docs.rglob("*.md"):
        found += [ROOT / m[1] for m in _INCLUDE.finditer(page.read_text(encoding="utf-8"))]
    return found


def on_files(files, config):
    """Add the images that included files show."""
    for source in _includes(config):
        for asset in _included_assets(source.read_text(encoding="utf-8"), source):
            rel = (Path("_included") / asset.relative_to(ROOT)).as_posix()
            files.append(File.generated(config, rel, abs_src_path=str(asset)))
    return files


def on_page_markdown(markdown, page, config, files):
    """Replace each ``{! path !}`` line with that file (a path from the repository root)."""
    def include(m: re.Match) -> str:
        source = ROOT / m[1]
        return _rewrite(source.read_text(encoding="utf-8"), source)
    return _INCLUDE.sub(include, markdown)
