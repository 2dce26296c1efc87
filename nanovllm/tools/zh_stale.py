"""Stale Chinese blocks: a function's code changed in a later commit than the block inside it.

For each function-level block (level 3) of every source file with blocks, `git blame` gives the
commit time of each line; the block is reported when the newest line of the function's code
(the function's lines minus the block's own) is newer than the newest line of the block. Lines
not yet committed count as newer than any commit. It warns, never fails: a change that leaves
the annotated behaviour alone is reported too, and an editor decides. Needs full history; in a
shallow clone, or outside git, it says so and reports nothing.
"""
from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from nanovllm.tools.zh_blocks import COMMENT_PREFIX, c_scopes, classify, find_blocks, python_scopes


@dataclass(frozen=True)
class Stale:
    path: str
    line: int  # the block's START marker
    name: str  # the function it annotates
    block_commit: str
    code_commit: str

    def __str__(self) -> str:
        return (f"{self.path}:{self.line}: block in {self.name} last changed in {self.block_commit[:10]}, "
                f"its code in {self.code_commit[:10]}")


def _git(root: Path, *args: str) -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, check=False)
    except OSError:
        return None
    return done.stdout if done.returncode == 0 else None


def history_note(root: Path) -> str | None:
    """Why no staleness can be judged here (not a git work tree, a shallow clone), or None."""
    if _git(root, "rev-parse", "--is-inside-work-tree") is None:
        return "not a git work tree"
    if (_git(root, "rev-parse", "--is-shallow-repository") or "").strip() == "true":
        return "shallow clone: blame needs the full history (git fetch --unshallow)"
    return None


def blame_times(root: Path, rel: str) -> list[tuple[int, str]] | None:
    """(commit time, commit) of each line of `rel`, 1-based as index + 1; None when untracked."""
    out = _git(root, "blame", "-w", "--porcelain", "--", rel)
    if out is None:
        return None
    now = int(time.time()) + 1
    times: dict[str, int] = {}
    result: list[tuple[int, str]] = []
    commit = ""
    for line in out.splitlines():
        if line.startswith("\t"):
            result.append((now if set(commit) == {"0"} else times.get(commit, 0), commit))
            continue
        head = line.split(" ")
        if len(head[0]) == 40 and all(c in "0123456789abcdef" for c in head[0]):
            commit = head[0]
        elif head[0] == "committer-time":
            times[commit] = int(head[1])
    return result


def stale_in_file(root: Path, rel: str) -> list[Stale]:
    path = root / rel
    text = path.read_text(encoding="utf-8")
    blocks, problems = find_blocks(rel, text, COMMENT_PREFIX[path.suffix])
    if problems or not blocks:
        return []
    first, scopes = (python_scopes if path.suffix == ".py" else c_scopes)(text)
    by_name = {s.name: s for s in scopes}
    times = None
    found = []
    for block in blocks:
        level, name = classify(block, first, scopes)
        if level != 3 or name not in by_name:
            continue
        if times is None:
            times = blame_times(root, rel)
            if times is None:
                return []
        scope = by_name[name]
        own = range(block.start, block.end + 1)
        inner = [b for b in blocks if scope.first <= b.start <= scope.last]  # no block is code
        skip = {n for b in inner for n in range(b.start, b.end + 1)}
        code = [times[n - 1] for n in range(scope.first, scope.last + 1) if n not in skip and n - 1 < len(times)]
        mine = [times[n - 1] for n in own if n - 1 < len(times)]
        if code and mine and max(code)[0] > max(mine)[0]:
            found.append(Stale(rel, block.start, name, max(mine)[1], max(code)[1]))
    return found


def stale(root: Path, files: list[Path]) -> list[Stale]:
    """Stale blocks among `files` (paths under `root`)."""
    found = []
    for path in files:
        found += stale_in_file(root, path.relative_to(root).as_posix())
    return found
