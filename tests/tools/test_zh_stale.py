"""zh_comments stale: a block is flagged once its function's code changes in a later commit."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from nanovllm.tools.zh_comments import main
from nanovllm.tools.zh_stale import (FORMAT_ONLY, REVIEWED, format_commits, history_note, load_reviews, read_reviews,
                                     split_reviewed, stale)

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


def test_blank_lines_before_a_later_function_are_not_its_code(tmp_path):
    repo = repo_with(tmp_path)
    (repo / "m.py").write_text(CODE + "\n\ndef sub(a, b):\n    return a - b\n", encoding="utf-8")
    git(repo, "commit", "-qam", "two", when=1_700_000_100)
    assert stale(repo, [repo / "m.py"]) == []


def review_line(repo: Path) -> str:
    commit = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], check=True, capture_output=True,
                            text=True).stdout.strip()
    return f"m.py add {commit[:10]}  # still right\n"


def test_a_reviewed_block_is_silent_until_its_code_changes_again(tmp_path, capsys):
    repo = repo_with(tmp_path)
    (repo / "m.py").write_text(CODE.replace("return a + b", "return b + a"), encoding="utf-8")
    git(repo, "commit", "-qam", "two", when=1_700_000_100)
    (repo / REVIEWED).parent.mkdir(parents=True)
    (repo / REVIEWED).write_text("# PATH FUNCTION COMMIT\n" + review_line(repo), encoding="utf-8")
    assert stale(repo, [repo / "m.py"]) == []
    assert main(["stale", str(repo)]) == 0
    out = capsys.readouterr().out
    assert "0 block(s)" in out and f"1 more read and recorded in {REVIEWED}" in out

    (repo / "m.py").write_text(CODE.replace("return a + b", "return a - b"), encoding="utf-8")
    git(repo, "commit", "-qam", "three", when=1_700_000_200)
    assert [s.name for s in stale(repo, [repo / "m.py"])] == ["add"]
    found, used, unused = split_reviewed(repo, [repo / "m.py"])
    assert (len(found), used, [(r.path, r.name, r.line) for r in unused]) == (1, [], [("m.py", "add", 2)])
    main(["stale", str(repo)])
    assert f"note: {REVIEWED}:2: m.py add" in capsys.readouterr().out


def test_a_review_of_another_function_or_commit_does_not_silence(tmp_path):
    repo = repo_with(tmp_path)
    (repo / "m.py").write_text(CODE.replace("return a + b", "return b + a"), encoding="utf-8")
    git(repo, "commit", "-qam", "two", when=1_700_000_100)
    line = review_line(repo)
    assert len(stale(repo, [repo / "m.py"], read_reviews(line.replace(" add ", " sub ")))) == 1
    assert len(stale(repo, [repo / "m.py"], read_reviews("m.py add 0123456789\n"))) == 1
    assert stale(repo, [repo / "m.py"], read_reviews(line)) == []


def test_malformed_review_lines_are_refused():
    for bad in ("m.py add\n", "m.py add 12345\n", "m.py add XYZ1234567\n", "m.py add 0123456 extra\n"):
        with pytest.raises(ValueError, match=":1: expected"):
            read_reviews(bad)
    assert read_reviews("# only a comment\n\n") == []


def test_stale_on_a_subfolder_names_paths_from_the_repository_root(tmp_path, capsys):
    repo = repo_with(tmp_path)
    (repo / "pkg").mkdir()
    (repo / "pkg" / "m.py").write_text(CODE, encoding="utf-8")
    git(repo, "add", "pkg")
    git(repo, "commit", "-qm", "two", when=1_700_000_100)
    (repo / "pkg" / "m.py").write_text(CODE.replace("return a + b", "return a - b"), encoding="utf-8")
    git(repo, "commit", "-qam", "three", when=1_700_000_200)
    main(["stale", str(repo / "pkg")])
    assert "warning: pkg/m.py:5: block in add" in capsys.readouterr().out


def test_every_review_in_the_tree_names_an_existing_function():
    from nanovllm.tools.zh_blocks import c_scopes, python_scopes
    root = Path(__file__).resolve().parents[2]
    for r in load_reviews(root):
        text = (root / r.path).read_text(encoding="utf-8")
        scopes = (python_scopes if r.path.endswith(".py") else c_scopes)(text)[1]
        assert r.name in {s.name for s in scopes}, f"{REVIEWED}:{r.line}: no {r.name} in {r.path}"


def head(repo: Path) -> str:
    return subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], check=True, capture_output=True,
                          text=True).stdout.strip()


def test_a_rewrap_listed_as_format_only_does_not_freshen_a_stale_block(tmp_path):
    repo = repo_with(tmp_path)
    (repo / "m.py").write_text(CODE.replace("return a + b", "return a - b"), encoding="utf-8")
    git(repo, "commit", "-qam", "code", when=1_700_000_100)
    (repo / "m.py").write_text(CODE.replace("return a + b", "return a - b").replace("返回两数之和。", "返回\n    # 两数之和。"),
                               encoding="utf-8")
    git(repo, "commit", "-qam", "rewrap", when=1_700_000_200)
    assert stale(repo, [repo / "m.py"]) == []  # the rewrap looks like an edit of the block
    (repo / FORMAT_ONLY).parent.mkdir(parents=True)
    (repo / FORMAT_ONLY).write_text(f"# form only\n{head(repo)}  # rewrap\n{'0' * 40}  # rebased away\n",
                                    encoding="utf-8")
    assert format_commits(repo) == [head(repo)]
    assert [s.name for s in stale(repo, [repo / "m.py"])] == ["add"]  # blamed through it: still stale
