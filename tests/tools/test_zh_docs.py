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
    assert wt.main(["--check", "--strict", str(doc)]) == 1  # no index yet: out of date
    assert wt.main(["--check", str(doc)]) == 0  # ... which alone only warns
    assert wt.main(["--write", str(doc)]) == 0
    assert wt.main(["--check", str(doc)]) == 0
    doc.write_text(doc.read_text(encoding="utf-8").replace("#L", "#L9", 1), encoding="utf-8")
    assert wt.main(["--check", "--strict", str(doc)]) == 1  # a stale line number


KNOB = re.compile(r"--[a-z][\w-]*|NANOVLLM_\w+|\b[a-z]+(?:_[a-z0-9]+)+\b")
TRANSLATED = ["tuning.md", "troubleshooting.md"]


def knobs(text: str) -> set[str]:
    """Flags, environment variables and snake_case names the page quotes in backticks."""
    return {k for span in re.findall(r"`([^`]+)`", re.sub(r"```.*?```", "", text, flags=re.S)) for k in KNOB.findall(span)}


def headings(text: str) -> list[set[str]]:
    """Each `## ` heading as the set of names it quotes."""
    return [set(re.findall(r"`([^`]+)`", h)) for h in re.findall(r"^## (.*)$", text, re.M)]


def drift(english: str, chinese: str) -> list[str]:
    problems = [f"{k} missing" for k in sorted(knobs(english) - knobs(chinese))]
    if headings(english) != headings(chinese):
        problems.append(f"sections differ: {headings(english)} vs {headings(chinese)}")
    return problems


def test_translations_keep_every_knob_and_section():
    for name in TRANSLATED:
        english = (ROOT / "docs" / name).read_text(encoding="utf-8")
        chinese = (ZH / name).read_text(encoding="utf-8")
        assert drift(english, chinese) == [], name


def test_drift_is_detected():
    english = "## `a_knob`\nset `--max-num-seqs` or `NANOVLLM_X`\n## Other\n"
    assert drift(english, "## `a_knob`\n`--max-num-seqs` `NANOVLLM_X`\n## 其他\n") == []
    assert drift(english, "## `a_knob`\n`--max-num-seqs`\n## 其他\n") == ["NANOVLLM_X missing"]
    assert drift(english, "## `a_knob`\n`--max-num-seqs` `NANOVLLM_X`\n") != []


def test_walkthrough_numbers_are_what_the_trace_prints():
    """The page's trace blocks and quoted numbers, against the request run for real (its own
    process: the trace sets torch's thread count)."""
    import subprocess
    import sys
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "zh_walkthrough.py"), "--check-trace"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "every trace block and quoted number matches" in done.stdout


def test_walkthrough_trace_check_finds_a_wrong_number():
    wt = _walkthrough()
    lines = ["step1.slot_mapping = 16..23", "step1.sample_rows = []", "block_size = 8"]
    page = ("`block_size = 8`, `step1.slot_mapping = 16..23`\n\n<!-- zh_walkthrough trace: step1 -->\n"
            "```text\nstep1.slot_mapping = 16..23\nstep1.sample_rows = []\n```\n")
    assert wt.check_trace(page, lines) == []
    assert wt.fill_trace(page, lines) == page
    quoted = page.replace("`step1.slot_mapping = 16..23`", "`step1.slot_mapping = 40..47`")
    assert [p.split(";")[0] for p in wt.check_trace(quoted, lines)] == ["`step1.slot_mapping = 40..47` in the text"]
    block = page.replace("sample_rows = []\n```", "sample_rows = [3]\n```")
    assert len(wt.check_trace(block, lines)) == 1
    assert wt.fill_trace(block, lines) == page
