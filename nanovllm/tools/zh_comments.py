"""The Chinese annotation layer: check, strip and count its `[ZH-START]` ... `[ZH-END]` blocks.

Annotations are comment blocks between two marker lines, kept apart from the code so that the
code can follow upstream and an English-only tree is one `strip` away (docs/architecture.md):

    python -m nanovllm.tools.zh_comments check [PATH]          markers paired, Chinese text, headers;
                                                               warns of block lines over 100 columns
                                                               (refuses them with --strict-width)
    python -m nanovllm.tools.zh_comments strip SRC --out DEST  English-only copy of a tree
    python -m nanovllm.tools.zh_comments strip FILE            one stripped file on stdout
    python -m nanovllm.tools.zh_comments stats [PATH]          levels present in each core module
    python -m nanovllm.tools.zh_comments stale [PATH]          blocks older than their code (warns;
                                                               still-right ones: zh_reviewed.txt;
                                                               form-only commits: zh_format_commits.txt)
    python -m nanovllm.tools.zh_comments wrap [PATH ...]       rewrap block prose to --max-width;
                                                               diagram lines are left to a human

Level 1 is a file header (column 0, before the first statement), level 2 a block in a class
body, level 3 a block in a function body (for C: inside a function). PATH defaults to the
repository root that holds this package.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

from nanovllm.tools.zh_stale import REVIEWED, history_note, split_reviewed, work_tree_root
from nanovllm.tools.zh_blocks import (COMMENT_PREFIX, Block, Problem, c_scopes, classify, find_blocks, python_scopes,
                                      strip_text, wide_lines)
from nanovllm.tools.zh_wrap import wrap_text

SKIP_DIRS = {".git", ".venv", "venv", "__pycache__", ".pytest_cache", ".hypothesis", "build", "dist", "node_modules"}
REPO_ROOT = Path(__file__).resolve().parents[2]
MAX_WIDTH = 100
"""Columns a block line may take (CJK characters count two): wider ones are warned of by `check`,
refused with `check --strict-width` (as tests/tools/test_zh_comments.py runs it), and rewrapped
by `wrap`, all but diagram lines, which a human redraws."""

CORE_MODULES: dict[str, list[str]] = {
    "nanovllm/engine/block_manager.py": [f"BlockManager.{m}" for m in (
        "match_prefix", "can_allocate", "allocate", "commit", "free", "_block_hash", "_take_free_block")],
    "nanovllm/engine/scheduler.py": [f"Scheduler.{m}" for m in (
        "finish", "_drop_dead_if_most", "schedule", "_schedule_running", "_schedule_waiting", "_preempt",
        "advance", "settle", "_finish_reason")],
    "nanovllm/engine/sequence.py": ["Sequence.__init__"],
    "nanovllm/engine/policy.py": ["make_policy"],
    "nanovllm/engine/model_runner.py": [f"ModelRunner.{m}" for m in (
        "_num_kv_blocks", "_allocate_kv_cache", "_measure_gpu_kv_blocks", "run", "_execute")],
    "nanovllm/engine/cuda_graphs.py": ["DecodeGraphs._capture", "DecodeGraphs.run"],
    "nanovllm/engine/step_input.py": ["StepInput.from_scheduled", "build_cpu_batch", "build_gpu_batch"],
    "nanovllm/engine/llm_engine.py": [f"LLMEngine.{m}" for m in ("__init__", "add_request", "abort", "step", "_settle",
                                                                  "_output")],
    "nanovllm/models/decoder.py": ["Attention.forward"],
    "nanovllm/layers/attention.py": [f"PagedAttention.{m}" for m in ("forward", "_forward_triton", "_decode", "_attend")],
    "nanovllm/engine/sampler.py": ["Sampler.__call__", "Sampler._choose"],
    "nanovllm/engine/constraints.py": ["constrain_rows", "apply_constraints"],
    "nanovllm/layers/penalties.py": ["apply_penalties_"],
    "nanovllm/layers/sampling_ops.py": ["sample_rows", "filter_candidates"],
    "nanovllm/layers/logits_processors.py": ["build_logits_processors", "BannedTokenSequences.__call__",
                                             "WordMatcher.advance", "WordMatcher.blocked", "BannedWords.__call__"],
    "nanovllm/layers/cpu_attention.c": ["paged_attention_rows", "attend_row", "paged_attention_chunk", "chunk_tile"],
    "nanovllm/layers/cpu_ops.c": ["qk_norm_rope_store_rows"],
    "nanovllm/kernels/triton_attention.py": ["_decode_kernel", "_prefill_kernel", "paged_decode_attention",
                                             "paged_prefill_attention"],
    "nanovllm/detokenize.py": ["_StopMatcher.scan", "IncrementalDetokenizer.add", "IncrementalDetokenizer._decode_next",
                               "IncrementalDetokenizer._release"],
    "tokenizer_proc/server.py": [f"TokenizerStage.{m}" for m in ("run", "handle", "_on_generate")],
    "tokenizer_proc/requests.py": ["RequestBuilder.build", "RequestBuilder._prompt_ids"],
    "engine_proc/server.py": [f"EngineStage.{m}" for m in (
        "run", "run_once", "_take_inbox")],
    "engine_proc/input.py": ["Input.loop", "Input._receive", "Input._receive_request"],
    "engine_proc/admission.py": [f"Admission.{m}" for m in ("queue", "admit", "abort", "record")],
    "engine_proc/output.py": ["Output.loop", "StreamHold.take"],
    "detok_proc/server.py": [f"DetokStage.{m}" for m in (
        "run", "on_step", "_act", "_abort_in_engine", "on_client_frames", "client_gone")],
    "detok_proc/streams.py": [f"RequestStreams.{m}" for m in ("step", "start", "advance", "fail")],
    "detok_proc/recovery.py": [f"Recovery.{m}" for m in ("resync", "resume", "hold")],
    "detok_proc/delivery.py": [f"Delivery.{m}" for m in ("stage_delta", "send", "_queue", "flush_pending")],
    "detok_proc/engine_watch.py": [f"EngineWatch.{m}" for m in ("status", "speaks")],
    "client/nanovllm_client/sync_client.py": ["Stream.__next__", "Client.stream", "Client._io_loop"],
    "client/nanovllm_client/client_state.py": ["ClientState.handle", "ClientState._unpark"],
    "client/nanovllm_client/async_client.py": ["AsyncStream.__anext__", "AsyncClient.stream", "AsyncClient._send",
                                               "AsyncClient._recheck", "AsyncClient._readable"],
}
"""Modules every reader passes through, and their key functions (`Class.method` or `function`)."""


@dataclass
class Coverage:
    path: str
    exists: bool
    header: bool = False
    classes: list[str] = field(default_factory=list)
    classes_annotated: list[str] = field(default_factory=list)
    keys: list[str] = field(default_factory=list)
    keys_annotated: list[str] = field(default_factory=list)
    keys_unknown: list[str] = field(default_factory=list)


def analyse(path: str, text: str, suffix: str, keys: list[str], blocks: list[Block]) -> Coverage:
    """Which levels `blocks` give the module; raises SyntaxError for Python that does not parse."""
    first, scopes = python_scopes(text) if suffix == ".py" else c_scopes(text)
    levels = [classify(b, first, scopes) for b in blocks]
    annotated = {name for level, name in levels if level in (2, 3)}
    classes = [s.name for s in scopes if s.kind == "class"]
    defined = {s.name for s in scopes}
    return Coverage(path, True, any(level == 1 for level, _ in levels), classes,
                    [c for c in classes if c in annotated], list(keys),
                    [k for k in keys if k in annotated], [k for k in keys if k not in defined])


# -- the tree -----------------------------------------------------------------------------------

def source_files(target: Path) -> list[Path]:
    """The .py/.c/.h files under `target` (or `target` itself), skipping caches and VCS folders."""
    if target.is_file():
        return [target] if target.suffix in COMMENT_PREFIX else []
    found = []
    for dirpath, dirnames, filenames in os.walk(target):
        dirnames[:] = sorted(d for d in dirnames if not _skipped(d))
        found += [Path(dirpath, f) for f in sorted(filenames) if Path(f).suffix in COMMENT_PREFIX]
    return found


def _skipped(dirname: str) -> bool:
    return dirname in SKIP_DIRS or dirname.endswith(".egg-info")


def core_module(path: Path) -> str | None:
    posix = path.resolve().as_posix()
    return next((m for m in CORE_MODULES if posix.endswith("/" + m)), None)


def check(target: Path) -> tuple[list[Problem], str]:
    """Every problem under `target` (a tree or one file), and a one-line summary."""
    files = source_files(target)
    problems: list[Problem] = []
    num_blocks = num_annotated = 0
    for path in files:
        shown = path.relative_to(target).as_posix() if target.is_dir() else str(path)
        text = path.read_text(encoding="utf-8")
        blocks, found = find_blocks(shown, text, COMMENT_PREFIX[path.suffix])
        problems += found
        num_blocks, num_annotated = num_blocks + len(blocks), num_annotated + bool(blocks)
        if (core := core_module(path)) is not None:
            problems += _core_problems(shown, text, path.suffix, CORE_MODULES[core], blocks)
    if target.is_dir() and (target / "nanovllm").is_dir():
        problems += [Problem(m, 0, "missing", "core module listed in CORE_MODULES does not exist")
                     for m in CORE_MODULES if not (target / m).is_file()]
    summary = f"{len(files)} source files, {num_blocks} Chinese blocks in {num_annotated} of them"
    return problems, summary


def too_wide(target: Path, max_width: int = MAX_WIDTH) -> list[Problem]:
    """Block lines under `target` (a tree or one file) wider than `max_width` columns."""
    found = []
    for path in source_files(target):
        shown = path.relative_to(target).as_posix() if target.is_dir() else str(path)
        text = path.read_text(encoding="utf-8")
        blocks, _ = find_blocks(shown, text, COMMENT_PREFIX[path.suffix])
        found += wide_lines(shown, text, blocks, max_width)
    return found


def _core_problems(shown: str, text: str, suffix: str, keys: list[str], blocks: list[Block]) -> list[Problem]:
    try:
        cov = analyse(shown, text, suffix, keys, blocks)
    except SyntaxError as e:
        return [Problem(shown, e.lineno or 0, "syntax", f"does not parse: {e.msg}")]
    problems = [] if cov.header else [Problem(shown, 1, "no-header", "core module has no level-1 header block "
                                              "(column 0, before the first statement)")]
    return problems + [Problem(shown, 1, "unknown-key", f"key function {k!r} from CORE_MODULES is not defined here")
                       for k in cov.keys_unknown]


def stripped(path: Path, shown: str) -> tuple[str, list[Problem]]:
    text = path.read_text(encoding="utf-8")
    blocks, problems = find_blocks(shown, text, COMMENT_PREFIX[path.suffix])
    return strip_text(text, blocks), problems


def strip_tree(src: Path, dest: Path) -> list[Problem]:
    """Copy `src` to `dest` with every block removed; writes nothing if any file has a problem."""
    if dest.exists() and any(dest.iterdir()):
        raise ValueError(f"{dest} is not empty")
    dest_abs = dest.resolve()
    sources, others, links, problems = {}, [], [], []
    for dirpath, dirnames, filenames in os.walk(src):
        here = Path(dirpath)
        dirnames[:] = [d for d in dirnames if not _skipped(d) and (here / d).resolve() != dest_abs]
        links += [here / d for d in dirnames if (here / d).is_symlink()]
        for name in filenames:
            path = here / name
            if path.is_symlink():
                links.append(path)
            elif path.suffix in COMMENT_PREFIX:
                sources[path], found = stripped(path, path.relative_to(src).as_posix())
                problems += found
            else:
                others.append(path)
    if problems:
        return problems
    for path in links:
        _target(path, src, dest).symlink_to(os.readlink(path))
    for path in others:
        shutil.copy2(path, _target(path, src, dest))
    for path, text in sources.items():
        _target(path, src, dest).write_text(text, encoding="utf-8")
        shutil.copymode(path, _target(path, src, dest))
    return []


def wrap_tree(targets: list[Path], max_width: int = MAX_WIDTH) -> tuple[list[Path], list[Problem]]:
    """Rewrap the blocks of every source file under `targets` in place: (files changed, problems
    of the files left alone because their markers are broken)."""
    changed, problems = [], []
    for path in (p for target in targets for p in source_files(target)):
        text = path.read_text(encoding="utf-8")
        blocks, found = find_blocks(str(path), text, COMMENT_PREFIX[path.suffix])
        if found:
            problems += found
            continue
        if (wrapped := wrap_text(text, blocks, COMMENT_PREFIX[path.suffix], max_width)) != text:
            path.write_text(wrapped, encoding="utf-8")
            changed.append(path)
    return changed, problems


def _target(path: Path, src: Path, dest: Path) -> Path:
    out = dest / path.relative_to(src)
    out.parent.mkdir(parents=True, exist_ok=True)
    return out


def coverage(root: Path) -> list[Coverage]:
    result = []
    for rel, keys in CORE_MODULES.items():
        path = root / rel
        if not path.is_file():
            result.append(Coverage(rel, False, keys=list(keys)))
            continue
        text = path.read_text(encoding="utf-8")
        blocks, _ = find_blocks(rel, text, COMMENT_PREFIX[path.suffix])
        result.append(analyse(rel, text, path.suffix, keys, blocks))
    return result


def stats_table(root: Path) -> str:
    rows = [("module", "L1", "L2 classes", "L3 key functions", "key functions without L3")]
    for cov in coverage(root):
        if not cov.exists:
            rows.append((cov.path, "missing", "", "", ""))
            continue
        l2 = f"{len(cov.classes_annotated)}/{len(cov.classes)}" if cov.classes else "-"
        rest = ", ".join(k for k in cov.keys if k not in cov.keys_annotated)
        rows.append((cov.path, "yes" if cov.header else "no", l2, f"{len(cov.keys_annotated)}/{len(cov.keys)}", rest))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    return "\n".join("  ".join([c.ljust(w) for c, w in zip(r, widths)] + [r[4]]).rstrip() for r in rows)


# -- command line -------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nanovllm.tools.zh_comments", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    check_cmd = sub.add_parser("check", help="markers paired, Chinese text present, core modules have headers")
    check_cmd.add_argument("path", nargs="?", type=Path, default=REPO_ROOT)
    check_cmd.add_argument("--max-width", type=int, default=MAX_WIDTH, help="columns a block line may take")
    check_cmd.add_argument("--strict-width", action="store_true", help="a wider line is a problem, not a warning")
    strip = sub.add_parser("strip", help="English-only copy of a tree (--out), or one file to stdout")
    strip.add_argument("path", type=Path)
    strip.add_argument("--out", type=Path)
    sub.add_parser("stats", help="annotation levels present in each core module").add_argument(
        "path", nargs="?", type=Path, default=REPO_ROOT)
    sub.add_parser("stale", help="function blocks whose code changed in a later commit (warning only)").add_argument(
        "path", nargs="?", type=Path, default=REPO_ROOT)
    wrap = sub.add_parser("wrap", help="rewrap block prose to --max-width in place (diagram lines untouched)")
    wrap.add_argument("paths", nargs="*", type=Path, default=[REPO_ROOT])
    wrap.add_argument("--max-width", type=int, default=MAX_WIDTH, help="columns a block line may take")
    args = parser.parse_args(argv)
    if args.command == "wrap":
        return _wrap(parser, args.paths, args.max_width)
    if not args.path.exists():
        parser.error(f"{args.path} does not exist")
    if args.command == "check":
        problems, summary = check(args.path)
        wide = too_wide(args.path, args.max_width)
        if args.strict_width:
            problems += wide
        else:
            for p in wide:
                print(f"warning: {p}", file=sys.stderr)
            summary += f" ({len(wide)} line(s) over {args.max_width} columns)" if wide else ""
        return _report(problems, f"zh_comments check: {summary}, no problems")
    if args.command == "stale":
        return _report_stale(args.path)
    if args.command == "stats":
        print(stats_table(args.path))
        return 0
    if args.path.is_dir():
        if args.out is None or (args.out.exists() and any(args.out.iterdir())):
            parser.error("strip of a folder needs --out DEST, a new or empty folder")
        return _report(strip_tree(args.path, args.out), f"zh_comments strip: wrote {args.out}")
    if args.path.suffix not in COMMENT_PREFIX:
        parser.error(f"strip works on {', '.join(COMMENT_PREFIX)} files and folders")
    text, problems = stripped(args.path, str(args.path))
    if not problems:
        (args.out.write_text(text, encoding="utf-8") if args.out else sys.stdout.write(text))
    return _report(problems, None)


def _wrap(parser: argparse.ArgumentParser, paths: list[Path], max_width: int) -> int:
    if missing := [str(p) for p in paths if not p.exists()]:
        parser.error(f"{', '.join(missing)} does not exist")
    if max_width < 40:
        parser.error(f"--max-width {max_width} is too narrow to wrap Chinese prose into (40 or more)")
    changed, problems = wrap_tree(paths, max_width)
    for path in changed:
        print(f"wrapped {path}")
    left = [p for target in paths for p in too_wide(target, max_width)]
    for p in left:
        print(f"warning: {p} (a diagram or an unbreakable line: fix it by hand)", file=sys.stderr)
    return _report(problems, f"zh_comments wrap: {len(changed)} file(s) rewrapped, "
                             f"{len(left)} block line(s) still over {max_width} columns")


def _report_stale(target: Path) -> int:
    """Print the stale blocks under `target` as warnings; always 0 (it informs, it never fails)."""
    root = work_tree_root(target.resolve())
    note = "not a git work tree" if root is None else history_note(root)
    if note:
        print(f"zh_comments stale: skipped ({note})")
        return 0
    files = [target.resolve()] if target.is_file() else source_files(target.resolve())
    try:
        found, reviewed, unused = split_reviewed(root, files)
    except ValueError as e:  # a malformed review line: say which, judge without the reviews
        print(f"warning: {e}")
        found, reviewed, unused = split_reviewed(root, files, [])
    for s in found:
        print(f"warning: {s}")
    for r in unused:
        print(f"note: {REVIEWED}:{r.line}: {r.path} {r.name} {r.commit} matches no stale block any more "
              "(its block or its code changed since): the line can go")
    print(f"zh_comments stale: {len(found)} block(s) older than the code they annotate"
          + (f" ({len(reviewed)} more read and recorded in {REVIEWED})" if reviewed else ""))
    return 0


def _report(problems: list[Problem], ok: str | None) -> int:
    for p in problems:
        print(p, file=sys.stderr)
    if problems:
        print(f"zh_comments: {len(problems)} problem(s)", file=sys.stderr)
        return 1
    if ok:
        print(ok)
    return 0


if __name__ == "__main__":
    sys.exit(main())
