"""Keep docs/zh/walkthrough.md pointing at code that exists.

The page names code as `path::Qualified.name` (a Python class or function, or a C function).
`--check` fails when a named file or name is gone; a line index (the section after INDEX_MARK)
that is no longer what `--write` would write is a warning, or a failure with `--strict` (line
numbers move with every edit elsewhere in a file, names should not). `--write` regenerates it.

    python scripts/zh_walkthrough.py --check [--strict] [DOC]
    python scripts/zh_walkthrough.py --write [DOC]
"""
from __future__ import annotations

import argparse
import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "zh" / "walkthrough.md"
REF = re.compile(r"`([\w./-]+\.(?:py|c))::([\w.]+)`")
INDEX_MARK = "<!-- zh_walkthrough: index generated below, do not edit by hand -->"
C_DEF = re.compile(r"^[A-Za-z_][\w \t*]*?\b(\w+)\s*\([^;]*$")


def definitions(path: Path) -> dict[str, int]:
    """Qualified name -> 1-based line of each class and function defined in `path`."""
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".c":
        return {m.group(1): n for n, line in enumerate(text.splitlines(), 1) if (m := C_DEF.match(line))}
    found: dict[str, int] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                found.setdefault(prefix + child.name, child.lineno)
                visit(child, prefix + child.name + ".")

    visit(ast.parse(text), "")
    return found


def references(body: str) -> list[tuple[str, str]]:
    seen: dict[tuple[str, str], None] = {}
    for ref in REF.findall(body):
        seen.setdefault(ref)
    return list(seen)


def resolve(refs: list[tuple[str, str]], root: Path = ROOT) -> tuple[list[str], list[str]]:
    """(index lines, problems) for the page's references."""
    index, problems = [], []
    cache: dict[str, dict[str, int]] = {}
    for rel, name in refs:
        path = root / rel
        if not path.is_file():
            problems.append(f"{rel}: file not found (named as {rel}::{name})")
            continue
        defs = cache.setdefault(rel, definitions(path))
        if name not in defs:
            problems.append(f"{rel}: no class or function {name}")
            continue
        index.append(f"- `{rel}::{name}` → [{rel}:{defs[name]}]({'../../' + rel}#L{defs[name]})")
    return index, problems


def render(text: str, root: Path = ROOT) -> tuple[str, list[str]]:
    body = text.split(INDEX_MARK)[0].rstrip("\n")
    index, problems = resolve(references(body), root)
    return body + "\n\n" + INDEX_MARK + "\n\n## 引用索引（行号）\n\n" + "\n".join(index) + "\n", problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", action="store_true")
    mode.add_argument("--write", action="store_true")
    parser.add_argument("--strict", action="store_true", help="with --check: an out-of-date line index fails")
    parser.add_argument("doc", nargs="?", type=Path, default=DOC)
    args = parser.parse_args(argv)
    text = args.doc.read_text(encoding="utf-8")
    new, problems = render(text)
    for p in problems:
        print(f"{args.doc}: {p}", file=sys.stderr)
    if problems:
        return 1
    if args.write:
        args.doc.write_text(new, encoding="utf-8")
        return 0
    if new != text:
        print(f"{args.doc}: line index out of date; run python scripts/zh_walkthrough.py --write", file=sys.stderr)
        if args.strict:
            return 1
    print(f"{args.doc}: {len(references(text.split(INDEX_MARK)[0]))} references, all present")
    return 0


if __name__ == "__main__":
    sys.exit(main())
