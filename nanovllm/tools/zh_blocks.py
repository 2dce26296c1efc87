"""One file's Chinese annotation blocks: find them, strip them, and tell where each one sits.

A block is a `# [ZH-START]` line, comment lines, and a `# [ZH-END]` line at one indentation
(`//` in C). `zh_comments` runs these over a tree; the conventions are in docs/architecture.md.
"""
from __future__ import annotations

import ast
import re
import unicodedata
from dataclasses import dataclass, field

START, END = "[ZH-START]", "[ZH-END]"
COMMENT_PREFIX = {".py": "#", ".c": "//", ".h": "//"}
CJK = re.compile(r"[\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]")


@dataclass(frozen=True)
class Problem:
    path: str
    line: int
    kind: str  # unpaired nested malformed not-comment indent no-chinese no-header unknown-key missing syntax
    message: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.message}"


@dataclass
class Block:
    start: int  # 1-based lines of the START and END markers
    end: int
    indent: str
    text: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Scope:
    first: int
    last: int
    kind: str  # "class" or "function"
    name: str  # qualified: "Class.method"


# -- blocks --------------------------------------------------------------------------------------

def find_blocks(path: str, text: str, prefix: str) -> tuple[list[Block], list[Problem]]:
    """The marked blocks of one file (comment `prefix` "#" or "//"), and what is wrong with them."""
    start_line, end_line = f"{prefix} {START}", f"{prefix} {END}"
    malformed = re.compile(rf"{re.escape(prefix)}\s*\[ZH-(START|END)\].*")
    blocks: list[Block] = []
    problems: list[Problem] = []
    block: Block | None = None
    for n, line in enumerate(text.splitlines(), 1):
        body, indent = line.strip(), line[:len(line) - len(line.lstrip())]
        if body == start_line:
            if block is None:
                block = Block(n, n, indent)
            else:
                problems.append(Problem(path, n, "nested", f"{START} inside the block opened on line {block.start}"))
        elif body == end_line:
            if block is None:
                problems.append(Problem(path, n, "unpaired", f"{END} without a {START} before it"))
                continue
            block.end = n
            problems += _closing_problems(path, block, indent)
            blocks.append(block)
            block = None
        elif malformed.fullmatch(body):
            problems.append(Problem(path, n, "malformed", f"marker must be exactly `{prefix} {START}` or `{prefix} {END}`"))
        elif block is not None:
            if not body.startswith(prefix) or indent != block.indent:
                problems.append(Problem(path, n, "not-comment", f"line in a {START} block is not a `{prefix}` comment "
                                        "at the block's indentation (strip would delete it)"))
            block.text.append(body[len(prefix):])
    if block is not None:
        problems.append(Problem(path, block.start, "unpaired", f"{START} never closed by a {END}"))
    return blocks, problems


def _closing_problems(path: str, block: Block, end_indent: str) -> list[Problem]:
    problems = []
    if end_indent != block.indent:
        problems.append(Problem(path, block.end, "indent", f"{END} not at the indentation of its {START} (line {block.start})"))
    if not any(CJK.search(t) for t in block.text):
        problems.append(Problem(path, block.start, "no-chinese", "block has no Chinese text"))
    return problems


def display_width(line: str) -> int:
    """Columns `line` takes in a terminal or editor: wide and full-width characters (CJK text,
    full-width punctuation) take two, every other character one."""
    return sum(2 if unicodedata.east_asian_width(c) in "WF" else 1 for c in line)


def wide_lines(path: str, text: str, blocks: list[Block], max_width: int) -> list[Problem]:
    """The lines of `blocks` (marker lines included) wider than `max_width` columns."""
    lines = text.splitlines()
    return [Problem(path, n, "wide", f"Chinese block line is {w} columns wide, over {max_width}")
            for b in blocks for n in range(b.start, b.end + 1) if (w := display_width(lines[n - 1])) > max_width]


def strip_text(text: str, blocks: list[Block]) -> str:
    """`text` without the lines of `blocks`, marker lines included; every other byte kept."""
    drop = {n for b in blocks for n in range(b.start, b.end + 1)}
    return "".join(line for n, line in enumerate(text.splitlines(keepends=True), 1) if n not in drop)


# -- where a block sits -------------------------------------------------------------------------

def python_scopes(text: str) -> tuple[int, list[Scope]]:
    """(line of the first statement after the module docstring, every class and function)."""
    tree, lines = ast.parse(text), text.splitlines()
    body = tree.body[1:] if tree.body and _is_docstring(tree.body[0]) else tree.body
    first = min([body[0].lineno] + [d.lineno for d in getattr(body[0], "decorator_list", [])]) if body else 1 << 30
    scopes: list[Scope] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                kind = "class" if isinstance(child, ast.ClassDef) else "function"
                last = _comments_after(lines, child.end_lineno or child.lineno, child.col_offset)
                scopes.append(Scope(child.lineno, last, kind, prefix + child.name))
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(tree, "")
    return first, scopes


def _comments_after(lines: list[str], last: int, col: int) -> int:
    """Extend a node that ends on line `last` over the comment lines indented past its `col`
    that follow it: a body that is only a docstring ends before the block written after it."""
    while last < len(lines):
        line = lines[last]
        if line.strip() and not (line.lstrip().startswith("#") and len(line) - len(line.lstrip()) > col):
            break
        last += 1
    return last


def _is_docstring(node: ast.stmt) -> bool:
    return isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)


_C_DEFINITION = re.compile(r"[A-Za-z_][\w \t*]*?\b([A-Za-z_]\w*)\s*\(")


def c_scopes(text: str) -> tuple[int, list[Scope]]:
    """(first line after the file's header comment, every function: from its column-0 signature
    to the column-0 `}` that closes it, the layout of this project's C files)."""
    first, in_comment, name, begin = 1 << 30, False, None, 0
    scopes: list[Scope] = []
    for n, line in enumerate(text.splitlines(), 1):
        s = line.strip()
        if first == 1 << 30:
            if in_comment or s.startswith("/*"):
                in_comment = "*/" not in s
            elif s and not s.startswith("//"):
                first = n
        if line.startswith("}") and name is not None:
            scopes.append(Scope(begin, n, "function", name))
            name = None
        elif (m := _C_DEFINITION.match(line)) and not line.startswith("typedef") and not s.endswith(";"):
            name, begin = m.group(1), n
    return first, scopes


def classify(block: Block, first_statement: int, scopes: list[Scope]) -> tuple[int, str | None]:
    """(level, the class or function it annotates): 1 header, 2 class, 3 function, 0 elsewhere."""
    inside = [s for s in scopes if s.first < block.start <= s.last]
    if inside:
        scope = max(inside, key=lambda s: s.first)  # the innermost
        return (2 if scope.kind == "class" else 3), scope.name
    if block.indent == "" and block.end < first_statement:
        return 1, None
    return 0, None
