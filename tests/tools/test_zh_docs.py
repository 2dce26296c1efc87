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


def _walkthrough():
    import importlib.util
    spec = importlib.util.spec_from_file_location("zh_walkthrough", ROOT / "scripts" / "zh_walkthrough.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_walkthrough_check_passes_on_the_tree():
    assert _walkthrough().main(["--check"]) == 0


def test_walkthrough_naming_a_missing_function_fails(tmp_path):
    wt = _walkthrough()
    doc = tmp_path / "w.md"
    doc.write_text("`nanovllm/engine/scheduler.py::Scheduler.schedule` 与 "
                   "`nanovllm/engine/scheduler.py::Scheduler.no_such_step`\n", encoding="utf-8")
    assert wt.main(["--write", str(doc)]) == 1
    doc.write_text("`nanovllm/engine/scheduler.py::Scheduler.schedule`\n", encoding="utf-8")
    assert wt.main(["--check", str(doc)]) == 1  # no index yet: out of date
    assert wt.main(["--write", str(doc)]) == 0
    assert wt.main(["--check", str(doc)]) == 0
    doc.write_text(doc.read_text(encoding="utf-8").replace("#L", "#L9", 1), encoding="utf-8")
    assert wt.main(["--check", str(doc)]) == 1  # a stale line number
