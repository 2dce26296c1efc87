"""zh_comments stale: a block is flagged once its function's code changes in a later commit."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

from nanovllm.tools.zh_comments import main
from nanovllm.tools.zh_stale import history_note, stale

START, END = "# [ZH-" + "START]", "# [ZH-" + "END]"  # split, so stripping this file leaves it alone
CODE = f'''"""Module."""


def add(a, b):
    {START}
    # 返回两数之和。
    {END}
    return a + b
'''


def git(repo: Path, *args: str, when: int = 1_700_000_000) -> None:
    env = dict(os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@t", GIT_COMMITTER_NAME="t",
               GIT_COMMITTER_EMAIL="t@t", GIT_AUTHOR_DATE=f"{when} +0000", GIT_COMMITTER_DATE=f"{when} +0000")
    subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, env=env)


def repo_with(tmp_path: Path) -> Path:
    git(tmp_path, "init", "-q")
    (tmp_path / "m.py").write_text(CODE, encoding="utf-8")
    git(tmp_path, "add", "m.py")
    git(tmp_path, "commit", "-qm", "one")
    return tmp_path


def test_fresh_block_is_not_flagged(tmp_path):
    repo = repo_with(tmp_path)
    assert history_note(repo) is None
    assert stale(repo, [repo / "m.py"]) == []


def test_code_changed_after_the_block_is_flagged(tmp_path, capsys):
    repo = repo_with(tmp_path)
    (repo / "m.py").write_text(CODE.replace("return a + b", "return a - b"), encoding="utf-8")
    git(repo, "commit", "-qam", "two", when=1_700_000_100)
    found = stale(repo, [repo / "m.py"])
    assert [(s.path, s.line, s.name) for s in found] == [("m.py", 5, "add")]
    assert main(["stale", str(repo)]) == 0  # a warning, never a failure
    assert "m.py:5: block in add" in capsys.readouterr().out


def test_block_updated_with_its_code_is_not_flagged(tmp_path):
    repo = repo_with(tmp_path)
    (repo / "m.py").write_text(CODE.replace("return a + b", "return a - b").replace("之和", "之差"),
                               encoding="utf-8")
    git(repo, "commit", "-qam", "two", when=1_700_000_100)
    assert stale(repo, [repo / "m.py"]) == []


def test_shallow_clone_is_skipped(tmp_path, capsys):
    (tmp_path / "src").mkdir()
    repo = repo_with(tmp_path / "src")
    (repo / "m.py").write_text(CODE.replace("return a + b", "return a - b"), encoding="utf-8")
    git(repo, "commit", "-qam", "two", when=1_700_000_100)
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", "--depth", "1", f"file://{repo}", str(clone)], check=True,
                   capture_output=True)
    assert "shallow" in (history_note(clone) or "")
    assert main(["stale", str(clone)]) == 0
    assert "skipped" in capsys.readouterr().out
