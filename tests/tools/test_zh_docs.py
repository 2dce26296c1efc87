"""docs/zh: every relative link resolves, and the start page keeps the README's commands."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ZH = ROOT / "docs" / "zh"
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def broken_links(doc: Path) -> list[str]:
    bad = []
    for target in LINK.findall(doc.read_text(encoding="utf-8")):
        if re.match(r"[a-z]+:", target):
            continue
        if not (doc.parent / target).exists():
            bad.append(target)
    return bad


def test_every_relative_link_in_docs_zh_resolves():
    docs = sorted(ZH.glob("*.md"))
    assert docs
    assert {d.name: broken_links(d) for d in docs} == {d.name: [] for d in docs}


def test_broken_link_is_detected(tmp_path):
    doc = tmp_path / "x.md"
    doc.write_text("[a](missing.md) [b](x.md) [c](https://example.org)", encoding="utf-8")
    assert broken_links(doc) == ["missing.md"]


def test_start_page_carries_the_readme_commands_verbatim():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    start = (ZH / "README.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```sh\n(.*?)```", readme, re.S)[:2]
    assert len(blocks) == 2
    for block in blocks:
        assert block in start
