"""Stale Chinese blocks: a function's code changed in a later commit than the block inside it.

For each function-level block (level 3) of every source file with blocks, `git blame` gives the
commit time of each line; the block is reported when the newest line of the function's code
(the function's lines minus its blocks and blank lines) is newer than the newest line of the
block. Lines not yet committed count as newer than any commit. It warns, never fails: a change
that leaves the annotated behaviour alone is reported too, and an editor decides: a block that is
out of date is edited (which makes it fresh), a block still right is listed in REVIEWED with the
commit its code was read at, and is reported again once its code changes in another commit.
Commits that only reformat blocks (`zh_comments wrap`, the diagram notation, the glossary's words)
are listed in FORMAT_ONLY and blamed through, so a rewrap neither makes a block look newer than
code it was never read against nor hides a change made on a branch merged beside it.
Needs full history; in a shallow clone, or outside git, it says so and reports nothing.
"""
from __future__ import annotations

import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from nanovllm.tools.zh_blocks import COMMENT_PREFIX, c_scopes, classify, find_blocks, python_scopes

REVIEWED = "nanovllm/tools/zh_reviewed.txt"
"""Blocks read against code newer than themselves and found right: `PATH FUNCTION COMMIT` per line."""
FORMAT_ONLY = "nanovllm/tools/zh_format_commits.txt"
"""Commits that changed blocks only in form, one full hash per line (`#` comments): blame looks through them."""


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


@dataclass(frozen=True)
class Review:
    path: str
    name: str
    commit: str  # the function's newest code commit when the block was read (a prefix of 7+ hex digits)
    line: int  # in REVIEWED

    def covers(self, s: Stale) -> bool:
        return (s.path, s.name) == (self.path, self.name) and s.code_commit.startswith(self.commit)


def read_reviews(text: str) -> list[Review]:
    """The records of a REVIEWED file; `#` starts a comment. Raises ValueError on a malformed line."""
    reviews = []
    for n, line in enumerate(text.splitlines(), 1):
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        if len(fields) != 3 or not 7 <= len(fields[2]) <= 40 or any(c not in "0123456789abcdef" for c in fields[2]):
            raise ValueError(f"{REVIEWED}:{n}: expected `PATH FUNCTION COMMIT` (commit: 7 to 40 lowercase hex "
                             f"digits), got {line.strip()!r}")
        reviews.append(Review(fields[0], fields[1], fields[2], n))
    return reviews


def load_reviews(root: Path) -> list[Review]:
    path = root / REVIEWED
    return read_reviews(path.read_text(encoding="utf-8")) if path.is_file() else []


def _git(root: Path, *args: str) -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, check=False)
    except OSError:
        return None
    return done.stdout if done.returncode == 0 else None


def work_tree_root(path: Path) -> Path | None:
    """The top of the git work tree holding `path` (a folder or a file), or None outside one."""
    out = _git(path if path.is_dir() else path.parent, "rev-parse", "--show-toplevel")
    return Path(out.strip()) if out else None


def history_note(root: Path) -> str | None:
    """Why no staleness can be judged here (not a git work tree, a shallow clone), or None."""
    if _git(root, "rev-parse", "--is-inside-work-tree") is None:
        return "not a git work tree"
    if (_git(root, "rev-parse", "--is-shallow-repository") or "").strip() == "true":
        return "shallow clone: blame needs the full history (git fetch --unshallow)"
    return None


def format_commits(root: Path) -> list[str]:
    """The FORMAT_ONLY commits under `root` that this repository has (a rebased one is skipped)."""
    path = root / FORMAT_ONLY
    if not path.is_file():
        return []
    listed = [line.split("#", 1)[0].strip() for line in path.read_text(encoding="utf-8").splitlines()]
    return [c for c in listed if c and _git(root, "rev-parse", "--verify", "--quiet", f"{c}^{{commit}}")]


def blame_times(root: Path, rel: str, ignore: Sequence[str] = ()) -> list[tuple[int, str]] | None:
    """(commit time, commit) of each line of `rel`, 1-based as index + 1, looking through the
    `ignore` commits; None when untracked."""
    out = _git(root, "blame", "-w", "--porcelain", *(a for c in ignore for a in ("--ignore-rev", c)), "--", rel)
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


def stale_in_file(root: Path, rel: str, ignore: Sequence[str] = ()) -> list[Stale]:
    path = root / rel
    text = path.read_text(encoding="utf-8")
    blocks, problems = find_blocks(rel, text, COMMENT_PREFIX[path.suffix])
    if problems or not blocks:
        return []
    first, scopes = (python_scopes if path.suffix == ".py" else c_scopes)(text)
    lines = text.splitlines()
    by_name = {s.name: s for s in scopes}
    times = None
    found = []
    for block in blocks:
        level, name = classify(block, first, scopes)
        if level != 3 or name not in by_name:
            continue
        if times is None:
            times = blame_times(root, rel, ignore)
            if times is None:
                return []
        scope = by_name[name]
        own = range(block.start, block.end + 1)
        inner = [b for b in blocks if scope.first <= b.start <= scope.last]  # no block is code
        skip = {n for b in inner for n in range(b.start, b.end + 1)}
        # Blank lines are nobody's code: the two before the next function belong to whoever added it.
        skip |= {n for n in range(scope.first, scope.last + 1) if n - 1 < len(lines) and not lines[n - 1].strip()}
        code = [times[n - 1] for n in range(scope.first, scope.last + 1) if n not in skip and n - 1 < len(times)]
        mine = [times[n - 1] for n in own if n - 1 < len(times)]
        if code and mine and max(code)[0] > max(mine)[0]:
            found.append(Stale(rel, block.start, name, max(mine)[1], max(code)[1]))
    return found


def stale(root: Path, files: list[Path], reviews: list[Review] | None = None) -> list[Stale]:
    """Stale blocks among `files` (paths under `root`), but those `reviews` (default: REVIEWED
    under `root`) record as read against the code they have now."""
    return split_reviewed(root, files, reviews)[0]


def split_reviewed(root: Path, files: list[Path], reviews: list[Review] | None = None
                   ) -> tuple[list[Stale], list[Review], list[Review]]:
    """(stale blocks not reviewed, the reviews that cover one, the reviews that cover none: their
    block or its code changed since, and the line can go)."""
    reviews = load_reviews(root) if reviews is None else reviews
    ignore = format_commits(root)
    found, scanned = [], set()
    for path in files:
        scanned.add(rel := path.relative_to(root).as_posix())
        found += stale_in_file(root, rel, ignore)
    used = [r for r in reviews if any(r.covers(s) for s in found)]
    unused = [r for r in reviews if r.path in scanned and r not in used]
    return [s for s in found if not any(r.covers(s) for r in reviews)], used, unused
