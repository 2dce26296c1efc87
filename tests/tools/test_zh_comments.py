"""The Chinese annotation layer's tool (nanovllm/tools/zh_comments.py): `strip` leaves the code
identical (same Python ASTs, same C object code), `check` names broken blocks by file and line,
`stats` covers every core module."""
from __future__ import annotations

import ast
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from nanovllm.tools import zh_comments as zh
from nanovllm.tools import zh_blocks as zb
from nanovllm.tools.zh_wrap import wrap_text

ROOT = Path(__file__).resolve().parents[2]
ANNOTATED_HERE = [m for m in zh.CORE_MODULES if m.endswith(".py")]
"""The Python core modules: every one carries the layer."""
CC = shutil.which("cc") or shutil.which("gcc")
START, END = f"# {zb.START}", f"# {zb.END}"


def plant_c_blocks(text: str) -> str:
    """`text` with a level-1 block after the header comment and a level-3 block at the top of
    every function body (the C files hold few blocks of their own yet)."""
    lines = text.splitlines(keepends=True)
    header_end = next(i for i, line in enumerate(lines) if "*/" in line) + 1
    bodies = []
    for scope in zb.c_scopes(text)[1]:
        bodies.append(next(i for i in range(scope.first - 1, scope.last) if lines[i].rstrip().endswith("{")) + 1)
    block = ["// [ZH-START]\n", "// 测试用的块：strip 之后目标代码必须逐字节相同\n", "// [ZH-END]\n"]
    for at in sorted(bodies + [header_end], reverse=True):
        indent = "" if at == header_end else "    "
        lines[at:at] = [indent + line for line in block]
    return "".join(lines)


@pytest.fixture(scope="module")
def stripped_repo(tmp_path_factory) -> tuple[Path, Path]:
    """(a copy of the repository with extra C blocks planted, its stripped copy)."""
    base = tmp_path_factory.mktemp("zh")
    src, out = base / "src", base / "out"
    shutil.copytree(ROOT, src, symlinks=True, ignore=shutil.ignore_patterns(*zh.SKIP_DIRS, "*.egg-info"))
    for path in (src / "nanovllm/layers").glob("*.[ch]"):
        path.write_text(plant_c_blocks(path.read_text(encoding="utf-8")), encoding="utf-8")
    assert zh.main(["strip", str(src), "--out", str(out)]) == 0
    return src, out


def test_strip_keeps_every_python_ast(stripped_repo):
    src, out = stripped_repo
    changed = 0
    for path in zh.source_files(src):
        if path.suffix != ".py":
            continue
        rel = path.relative_to(src)
        before, after = path.read_text(encoding="utf-8"), (out / rel).read_text(encoding="utf-8")
        assert ast.dump(ast.parse(after)) == ast.dump(ast.parse(before)), rel
        assert zb.find_blocks(str(rel), after, "#") == ([], []), rel
        changed += before != after
    assert changed >= len(ANNOTATED_HERE)
    assert (out / "README.md").read_bytes() == (src / "README.md").read_bytes()
    assert (out / "nanovllm/systemd").is_symlink() and not (out / ".git").exists()


def test_strip_removes_exactly_the_blocks(stripped_repo):
    src, out = stripped_repo
    for path in (src / "nanovllm/layers").glob("*.[ch]"):
        pristine = (ROOT / path.relative_to(src)).read_text(encoding="utf-8")
        expected = zb.strip_text(pristine, zb.find_blocks(path.name, pristine, "//")[0])
        assert (out / path.relative_to(src)).read_text(encoding="utf-8") == expected, path.name
    for rel in ANNOTATED_HERE:
        text = (out / rel).read_text(encoding="utf-8")
        assert zb.START not in text and not any(0x4E00 <= ord(c) <= 0x9FFF for c in text), rel


@pytest.mark.skipif(CC is None, reason="no C compiler")
def test_strip_keeps_c_object_code(stripped_repo, tmp_path):
    src, out = stripped_repo
    sources = [p.relative_to(src) for p in (src / "nanovllm/layers").glob("*.c")]
    assert sources
    jobs = {}
    for tree in (src, out):
        for rel in sources:
            obj = tmp_path / f"{tree.name}-{rel.stem}.o"
            cmd = [CC, "-O2", "-march=native", "-fopenmp", "-I", "nanovllm/layers", "-c", str(rel), "-o", str(obj)]
            jobs[obj] = subprocess.Popen(cmd, cwd=tree)
    assert all(job.wait() == 0 for job in jobs.values())
    for rel in sources:
        original, stripped = (tmp_path / f"{tree}-{rel.stem}.o" for tree in ("src", "out"))
        assert original.read_bytes() == stripped.read_bytes(), rel


def test_check_passes_on_the_repo():
    problems, summary = zh.check(ROOT)
    assert [str(p) for p in problems] == []
    assert "Chinese blocks" in summary


def test_every_block_line_fits_the_width():
    """What `check --strict-width` refuses: a block line over MAX_WIDTH columns (`zh_comments
    wrap` fixes prose; a diagram is redrawn by hand)."""
    wide = [str(p) for p in zh.too_wide(ROOT)]
    assert wide == []


@pytest.fixture
def module_copy(tmp_path) -> tuple[Path, list[str]]:
    """A copy of block_manager.py at its package path in tmp, and its lines."""
    path = tmp_path / "nanovllm/engine/block_manager.py"
    path.parent.mkdir(parents=True)
    shutil.copy(ROOT / "nanovllm/engine/block_manager.py", path)
    return path, path.read_text(encoding="utf-8").splitlines()


def first_method_block(lines: list[str]) -> int:
    return lines.index("        " + START)


def plant(name: str, lines: list[str]) -> tuple[list[str], str, int]:
    """(lines with one planted defect, the problem kind, its 1-based line)."""
    lines, i = list(lines), first_method_block(lines)
    if name == "unclosed":
        return lines + [START, "# 没有结尾的块"], "unpaired", len(lines) + 1
    if name == "stray-end":
        return lines + [END], "unpaired", len(lines) + 1
    if name == "nested":
        lines.insert(i + 1, "        " + START)
        return lines, "nested", i + 2
    if name == "no-chinese":
        return lines + [START, "# English only", END], "no-chinese", len(lines) + 1
    if name == "code-inside":
        lines.insert(i + 1, "        x = 1")
        return lines, "not-comment", i + 2
    if name == "malformed":
        return lines + ["#[ZH-START]"], "malformed", len(lines) + 1
    assert name == "no-header"
    start = lines.index(START)
    return lines[:start] + lines[lines.index(END) + 1:], "no-header", 1


def test_check_passes_on_a_clean_copy(module_copy, capsys):
    path, _ = module_copy
    assert zh.main(["check", str(path)]) == 0
    assert "no problems" in capsys.readouterr().out


@pytest.mark.parametrize("defect", ["unclosed", "stray-end", "nested", "no-chinese", "code-inside", "malformed",
                                    "no-header"])
def test_check_names_file_and_line_of_a_planted_defect(module_copy, capsys, defect):
    path, lines = module_copy
    planted, kind, line = plant(defect, lines)
    path.write_text("\n".join(planted) + "\n", encoding="utf-8")
    problems, _ = zh.check(path)
    assert [(p.kind, p.line) for p in problems] == [(kind, line)]
    assert zh.main(["check", str(path)]) == 1
    assert f"{path}:{line}: " in capsys.readouterr().err


def test_strip_refuses_a_file_with_broken_markers(module_copy, capsys):
    path, lines = module_copy
    path.write_text("\n".join(plant("unclosed", lines)[0]) + "\n", encoding="utf-8")
    assert zh.main(["strip", str(path)]) == 1
    assert capsys.readouterr().out == ""


def test_stats_lists_every_core_module_and_full_coverage_of_ours(capsys):
    assert zh.main(["stats", str(ROOT)]) == 0
    table = capsys.readouterr().out
    coverage = {c.path: c for c in zh.coverage(ROOT)}
    assert list(coverage) == list(zh.CORE_MODULES)
    for module, c in coverage.items():
        assert module in table
        assert c.exists and c.keys_unknown == [], f"{module}: CORE_MODULES names {c.keys_unknown}"
    for module, c in coverage.items():  # every core module on all three levels
        assert c.header and c.classes_annotated == c.classes and c.keys_annotated == c.keys, module


def test_stats_sees_a_missing_method_block_and_c_levels(module_copy, stripped_repo):
    path, lines = module_copy
    at = lines.index('        """Offer the blocks whose K/V are now written to the prefix cache (after a step)."""') + 1
    end = lines.index("        " + END, at)
    path.write_text("\n".join(lines[:at] + lines[end + 1:]) + "\n", encoding="utf-8")
    c = next(c for c in zh.coverage(path.parents[2]) if c.path == "nanovllm/engine/block_manager.py")
    assert c.header and "BlockManager.commit" not in c.keys_annotated and len(c.keys_annotated) == len(c.keys) - 1
    planted_c = next(c for c in zh.coverage(stripped_repo[0]) if c.path.endswith(".c"))
    assert planted_c.header and planted_c.keys_annotated == planted_c.keys


def test_a_block_after_a_docstring_only_body_belongs_to_that_body():
    text = "\n".join([
        '"""A module."""', START, "# 文件头", END, "",
        "class Rejected(ValueError):", '    """Only a docstring."""', "    " + START, "    # 类的说明", "    " + END, "",
        "class Policy:", "    def key(self):", '        """Abstract."""', "        " + START, "        # 1. 步骤",
        "        " + END, "    " + START, "    # 跟在方法后面、缩进在类体里：属于类，不属于方法", "    " + END, ""])
    blocks, problems = zb.find_blocks("m.py", text, "#")
    assert problems == []
    coverage = zh.analyse("m.py", text, ".py", ["Policy.key"], blocks)
    assert coverage.header and coverage.classes_annotated == ["Rejected", "Policy"]
    assert coverage.keys_annotated == ["Policy.key"]


def test_a_block_line_over_the_width_is_warned_of_and_refused_when_strict(module_copy, capsys):
    path, lines = module_copy
    i = first_method_block(lines)
    assert zh.main(["check", "--strict-width", str(path)]) == 0  # the module's own lines fit
    lines.insert(i + 1, "        # " + "块表" * 50)  # 8 + 2 + 200 columns: each CJK character takes two
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    assert [(p.kind, p.line) for p in zh.too_wide(path)] == [("wide", i + 2)]
    assert zh.too_wide(path, max_width=210) == []
    assert zh.main(["check", str(path)]) == 0  # a warning by default
    out = capsys.readouterr()
    assert f"warning: {path}:{i + 2}: Chinese block line is 210 columns wide, over 100" in out.err
    assert "1 line(s) over 100 columns" in out.out
    assert zh.main(["check", "--strict-width", str(path)]) == 1
    assert zh.main(["check", "--strict-width", "--max-width", "210", str(path)]) == 0


def test_display_width_counts_cjk_twice():
    from nanovllm.tools.zh_blocks import display_width
    assert display_width("abc") == 3
    assert display_width("块表，") == 6  # full-width punctuation too
    assert display_width("──▶") == 3  # box drawing and arrows are narrow


# -- wrap ---------------------------------------------------------------------------------------

def no_space(text: str) -> str:
    return "".join(text.split())


def blocks_of(text: str, prefix: str = "#") -> list[zb.Block]:
    blocks, problems = zb.find_blocks("m", text, prefix)
    assert problems == []
    return blocks


WRAP_SAMPLE = "\n".join([
    '"""A module."""', START,
    "# 【模块定位】" + "调度器决定这一步算哪些 token，模型执行器把它们送进模型、读写分页 KV cache，" * 2 + "最后采样。",
    "# 1. 第一步：" + "块表" * 30 + "，然后调用 `BlockManager.allocate(seq, num_tokens)` 分配 slot_mapping 与 block_table。",
    "#    a. 子步骤：" + "前缀缓存命中" * 12 + "。",
    "# 2. 短的一步。",
    "#   客户端 → tokenizer_proc → engine_proc → detok_proc → 客户端" + " → 客户端" * 12,
    "# ┌──────┐" + "─" * 120,
    "# -> " + "箭头开头的行" * 20,
    "#", "# ```", "# " + "围栏里的行" * 30, "# ```", END, "x = 1", ""])


def test_wrap_fits_prose_to_the_width_and_leaves_diagrams_alone():
    wrapped = wrap_text(WRAP_SAMPLE, blocks_of(WRAP_SAMPLE), "#", 60)
    lines = wrapped.splitlines()
    wide = [ln for ln in lines if zb.display_width(ln) > 60]
    assert wide == [ln for ln in WRAP_SAMPLE.splitlines() if "→" in ln or "─" in ln or "箭头" in ln or "围栏" in ln]
    item = lines.index(next(ln for ln in lines if ln.startswith("# 1. ")))
    assert lines[item + 1].startswith("#    ") and not lines[item + 1].startswith("#     ")  # hangs under the text
    sub = lines.index(next(ln for ln in lines if ln.startswith("#    a. ")))
    assert lines[sub + 1].startswith("#" + " " * 7) and lines[sub + 1][8] != " "
    for ln in lines[1:lines.index(END)]:
        body = ln[1:].strip()
        assert not body or body[0] not in "，。、；：）", ln  # no line opens with closing punctuation
    assert "`BlockManager.allocate(seq, num_tokens)`" in wrapped  # a code span is never broken
    words = {w for ln in WRAP_SAMPLE.splitlines() for w in re.findall(r"[A-Za-z_]{3,}", ln)}
    assert words <= {w for ln in lines for w in re.findall(r"[A-Za-z_]{3,}", ln)}  # nor an ASCII word
    assert wrapped.endswith(f"{END}\nx = 1\n")


def test_wrap_changes_only_whitespace_at_the_breaks_and_twice_is_once():
    wrapped = wrap_text(WRAP_SAMPLE, blocks_of(WRAP_SAMPLE), "#", 60)
    assert wrapped != WRAP_SAMPLE
    new, old = blocks_of(wrapped), blocks_of(WRAP_SAMPLE)
    assert no_space("".join(new[0].text)) == no_space("".join(old[0].text))
    assert zb.strip_text(wrapped, new) == zb.strip_text(WRAP_SAMPLE, old)
    assert wrap_text(wrapped, blocks_of(wrapped), "#", 60) == wrapped
    assert wrap_text(WRAP_SAMPLE, blocks_of(WRAP_SAMPLE), "#", 400) == WRAP_SAMPLE  # nothing over: nothing moves
    crlf = WRAP_SAMPLE.replace("\n", "\r\n")
    assert wrap_text(crlf, blocks_of(crlf), "#", 60) == wrapped.replace("\n", "\r\n")  # line endings kept


def test_wrap_keeps_the_repository_code_and_text_and_is_idempotent(tmp_path):
    """On a copy of every annotated source file: the code is byte-identical after `wrap`, each
    block's text differs only in whitespace, and a second run changes nothing."""
    copies = {}
    for path in zh.source_files(ROOT):
        text = path.read_text(encoding="utf-8")
        if zb.START in text and "tests" not in path.relative_to(ROOT).parts:
            copies[path] = tmp_path / path.relative_to(ROOT)
            copies[path].parent.mkdir(parents=True, exist_ok=True)
            copies[path].write_text(text, encoding="utf-8")
    assert zh.main(["wrap", "--max-width", "80", str(tmp_path)]) == 0
    for path, copy in copies.items():
        prefix = zb.COMMENT_PREFIX[path.suffix]
        before, after = path.read_text(encoding="utf-8"), copy.read_text(encoding="utf-8")
        old, new = blocks_of(before, prefix), blocks_of(after, prefix)
        assert zb.strip_text(after, new) == zb.strip_text(before, old), path
        assert [no_space("".join(b.text)) for b in new] == [no_space("".join(b.text)) for b in old], path
    assert zh.wrap_tree([tmp_path], 80) == ([], [])


def test_wrap_on_the_command_line_names_what_it_changed_and_what_is_left(tmp_path, capsys):
    path = tmp_path / "m.py"
    path.write_text(WRAP_SAMPLE, encoding="utf-8")
    assert zh.main(["wrap", "--max-width", "60", str(path)]) == 0
    out = capsys.readouterr()
    assert f"wrapped {path}" in out.out and "block line(s) still over 60 columns" in out.out
    assert "fix it by hand" in out.err
    path.write_text(WRAP_SAMPLE + START + "\n", encoding="utf-8")  # broken markers: left alone
    assert zh.main(["wrap", "--max-width", "60", str(path)]) == 1
    assert path.read_text(encoding="utf-8") == WRAP_SAMPLE + START + "\n"


def test_wrap_keeps_numbers_with_units_and_formulas_whole_and_follows_a_hanging_indent():
    prose = ("等待" * 14 + "最多阻塞 50 ms，预算 = 帧长 + 每个 token 40 字节，" + "然后继续读取下一帧" * 3
             + "，档位 1、2、4、8、16、32、48、64、80、96，")
    text = "\n".join([START, "#   输入线程：" + prose, "#     " + "续行" * 10 + "。", END, ""])
    wrapped = wrap_text(text, blocks_of(text), "#", 60)
    lines = wrapped.splitlines()[1:-1]
    assert all(zb.display_width(ln) <= 60 for ln in lines)
    joined = " ".join(ln[1:].strip() for ln in lines)
    assert "50 ms" in joined and "预算 = 帧长 + 每个 token 40 字节" in joined  # no break inside either
    assert "1、2、4、8、16、32、48、64、80、96" in joined  # nor inside a list of numbers
    assert all(ln.startswith("#     ") for ln in lines[1:])  # the continuation hangs where the author put it
    assert wrap_text(wrapped, blocks_of(wrapped), "#", 60) == wrapped


def _block_prose():
    """(file:line, line, its prose) for every block line of the tree's sources, `code spans`
    removed from the prose (inside one an arrow or a word is code, e.g. a return annotation)."""
    for path in zh.source_files(ROOT):
        if "tests" in path.relative_to(ROOT).parts or path.parent.name == "tools":
            continue
        text = path.read_text(encoding="utf-8")
        for block in zb.find_blocks(str(path), text, zb.COMMENT_PREFIX[path.suffix])[0]:
            for n, line in enumerate(block.text, block.start + 1):
                yield f"{path.relative_to(ROOT)}:{n}", line, re.sub(r"`[^`]*`", "", line)


def test_every_block_draws_with_one_arrow():
    """The glossary's notation (docs/zh/README.md): `→` and `─label→`, never `──▶` or `->`."""
    found = [f"{where}: {line.strip()}" for where, line, prose in _block_prose() if "▶" in prose or "->" in prose]
    assert found == []


# Variants the glossary (docs/zh/README.md) settles on one word for: the variant, the word.
GLOSSARY_VARIANTS = {"decode 步": "解码步", "分块 prefill": "prefill 分块", "反分词器进程": "反分词进程",
                     "分词器进程": "分词进程"}


def test_blocks_use_the_glossary_words():
    found = [f"{where}: {bad!r}, the glossary says {good!r}" for where, _, prose in _block_prose()
             for bad, good in GLOSSARY_VARIANTS.items() if bad in prose]
    assert found == []


def test_wrap_spills_at_the_hanging_indent_the_author_used_below_a_finished_sentence():
    text = "\n".join([START, "# 【边界】" + "不编译语法" * 12 + "。", "#        " + "续行" * 10 + "。", END, ""])
    lines = wrap_text(text, blocks_of(text), "#", 60).splitlines()[1:-1]
    assert len(lines) == 4 and all(ln.startswith("#" + " " * 8) and ln[9] != " " for ln in lines[1:])
    assert lines[3] == "#        " + "续行" * 10 + "。"  # its own paragraph, untouched


def test_no_block_is_required_on_a_function_of_one_or_two_lines():
    """A key function in CORE_MODULES has more than two lines of code (docstring and block aside):
    a block on a one-liner narrates it instead of teaching anything (an author may still write one)."""
    import ast

    short = []
    for rel, keys in zh.CORE_MODULES.items():
        if not rel.endswith(".py"):
            continue
        tree = ast.parse((ROOT / rel).read_text(encoding="utf-8"))
        defs = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                defs.update({f"{node.name}.{f.name}": f for f in node.body
                             if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))})
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                defs.setdefault(node.name, node)
        for key in keys:
            if key in defs:
                body = [s for s in defs[key].body
                        if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
                if sum(s.end_lineno - s.lineno + 1 for s in body) <= 2:
                    short.append(f"{rel}: {key}")
    assert short == []
