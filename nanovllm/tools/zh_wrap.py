"""Rewrap the prose lines of Chinese annotation blocks to a width (`zh_comments wrap`).

A line over the width is broken at the last point that fits: a space outside a `code span`, or
between two wide characters (CJK text, full-width punctuation), never before closing punctuation
（，。、；：）」 and the like) nor after opening punctuation, never inside an ASCII word, between a
number and its unit ("50 ms", "64 个") or around an operator ("a + b"). What does
not fit moves to the front of the paragraph's next line, or onto a new line at the paragraph's
hanging indent, so the author's other breaks stay where they are. A paragraph is a line and the
lines after it at its hanging indent, up to a line that ends a sentence. Diagram lines are left
to a human: box-drawing characters, a leading arrow, two arrows outside a list item's text (a
flow), aligned columns (three spaces inside a line), anything inside a ``` fence.
Only whitespace at the break points changes; a second run changes nothing.
"""
from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass

from nanovllm.tools.zh_blocks import CJK, Block, display_width

CLOSING = set("，。、；：？！）」』》】〉”’…—～·,.;:?!)]}%")
"""Characters a line must not start with: they close or end what comes before them."""
OPENING = set("（「『《【〈“‘([{")
"""Characters a line must not end with: they open what comes after them."""
FULL_PUNCT = set("，。、；：？！（）「」『』《》【】〈〉“”‘’…—～·")
SENTENCE_END = ("。", "！", "？")
DIAGRAM = re.compile(r"[\u2500-\u259f\u25b2-\u25c4\u25bc\u25be]")  # box drawing, blocks, ▲▶▼◀
LEADING_ARROW = re.compile(r"(->|<-|=>|→|←|↑|↓|⇒|⇐|↔|\||\+-|`{3})")
ARROW = re.compile(r"->|→|⇒|─▶|=>")
OPERATORS = {"=", "+", "-", "*", "/", "//", "%", "×", "<", ">", "<=", ">=", "==", "!=", "|", "&"}
CODE_SPAN = re.compile(r'`[^`]*`|"[^"]*"')
MARKER = re.compile(r"(\d+\.|[a-z]\.|[-*•]|\(\d+\)|（\d+）)\s+")
"""A list item's marker and the spaces after it: continuation lines hang under its text."""
PUNCT_BONUS, SPACE_BONUS = 30, 16
"""Columns a break after punctuation (or at a space) may give up to beat one inside a run of CJK text."""
SHORT = 20
"""Columns a paragraph's last line should leave on the new line it spills onto (no one-word lines)."""


def _wide(c: str) -> bool:
    return unicodedata.east_asian_width(c) in "WF"


@dataclass
class _Line:
    indent: int  # spaces after the comment prefix
    text: str  # the rest, stripped
    verbatim: bool
    hanging: int  # where this line's continuation lines start
    joins: bool  # continues the paragraph of the line before it
    raw: str | None = None  # the line as found, kept while its paragraph needs no change


def wrap_block(lines: list[str], block: Block, prefix: str, max_width: int) -> list[str]:
    """The comment lines of `block` (between its markers; `lines` is the whole file) rewrapped."""
    code_indent = block.indent + prefix + " "
    parsed = _parse([lines[n - 1] for n in range(block.start + 1, block.end)], prefix)
    if parsed is None:  # a line without the usual "prefix space" shape: leave the block alone
        return lines[block.start:block.end - 1]
    out: list[_Line] = []
    i = 0
    while i < len(parsed):
        j = i + 1
        while j < len(parsed) and parsed[j].joins:
            j += 1
        out += _wrap_paragraph(parsed[i:j], len(code_indent), max_width)
        i = j
    return [ln.raw if ln.raw is not None else (code_indent + " " * ln.indent + ln.text).rstrip() for ln in out]


def _parse(raw: list[str], prefix: str) -> list[_Line] | None:
    parsed: list[_Line] = []
    fenced = False
    for line in raw:
        body = line.strip()[len(prefix):]
        if body and not body.startswith(" "):
            return None
        content = body[1:]
        text = content.lstrip(" ")
        indent = len(content) - len(text)
        if not text:
            parsed.append(_Line(0, "", True, 0, False, line))
            continue
        if text.startswith("```"):
            fenced = not fenced
            parsed.append(_Line(indent, text, True, indent, False, line))
            continue
        marker = MARKER.match(text)
        before = parsed[-1] if parsed else None
        verbatim = fenced or bool(DIAGRAM.search(text)) or bool(LEADING_ARROW.match(text)) or "   " in text
        # A plain line hangs its continuation lines deeper ("输入线程：..." then lines indented under it).
        hangs = (before is not None and not before.joins and not MARKER.match(before.text)
                 and before.hanging == before.indent < indent and not before.text.endswith(("：", ":")))
        joins = (not verbatim and not marker and not text.startswith("【") and before is not None
                 and not before.verbatim and (indent == before.hanging or hangs)
                 and not before.text.endswith(SENTENCE_END))
        if not (marker or joins) and len(ARROW.findall(text)) >= 2:
            verbatim = True  # a flow drawn on one line; in a list item's text, arrows are prose
        if hangs and not verbatim and not marker:
            before.hanging = indent  # even when a sentence ends there: the author's hanging indent
        hanging = indent + marker.end() if marker else (before.hanging if joins else indent)
        parsed.append(_Line(indent, text, verbatim, hanging, joins, line))
    return parsed


def _wrap_paragraph(para: list[_Line], lead: int, max_width: int) -> list[_Line]:
    """Push what does not fit on each line to the front of the next; the last one spills onto new lines."""
    if all(ln.verbatim or lead + ln.indent + display_width(ln.text) <= max_width for ln in para):
        return para  # raw lines kept byte for byte
    out: list[_Line] = []
    carry = ""
    for k, ln in enumerate(para):
        text = _join(carry, ln.text) if carry else ln.text
        indent = ln.indent
        while True:
            head, tail = _split(text, max_width - lead - indent, last=k + 1 == len(para))
            if not tail:
                out.append(_Line(indent, head, ln.verbatim, ln.hanging, ln.joins))
                carry = ""
                break
            out.append(_Line(indent, head, False, ln.hanging, ln.joins if indent == ln.indent else True))
            if k + 1 < len(para):
                carry = tail
                break
            text, indent = tail, ln.hanging
    return out


def _split(text: str, width: int, last: bool = False) -> tuple[str, str]:
    """(the longest head of `text` that fits `width` columns ending at a break point, the rest);
    ("text", "") when it fits or has no break point that fits. A break after punctuation or at a
    space is preferred to one inside a run of CJK text (PUNCT_BONUS, SPACE_BONUS); on a
    paragraph's `last` line, one that leaves at least SHORT columns on the new line is."""
    if display_width(text) <= width:
        return text, ""
    found: list[tuple[str, str, int, int]] = []  # (head, tail, head's width, bonus)
    protected = _protected(text)
    used = 0
    for k, c in enumerate(text):
        if k and not protected[k] and _may_break(text, k):
            head, tail = text[:k].rstrip(" "), text[k:].lstrip(" ")
            if head and tail and not _looks_special(tail):
                bonus = PUNCT_BONUS if text[k - 1] in FULL_PUNCT else SPACE_BONUS if c == " " else 0
                found.append((head, tail, used, bonus))
        used += 2 if _wide(c) else 1
        if used > width:
            break
    if last:
        total = display_width(text)
        found = [f for f in found if total - f[2] >= SHORT and f[2] >= width // 2] or found
    if not found:
        return text, ""
    best = max(reversed(found), key=lambda f: f[2] + f[3])  # ties: the later break
    return best[0], best[1]


def _protected(text: str) -> list[bool]:
    """Per character: inside a `code span` or an ASCII "quoted string" (no break there)."""
    inside = [False] * (len(text) + 1)
    for span in CODE_SPAN.finditer(text):
        if span.group(0)[0] == "`" or not CJK.search(span.group(0)):
            inside[span.start() + 1:span.end()] = [True] * (span.end() - span.start() - 1)
    return inside


def _may_break(text: str, k: int) -> bool:
    """May a line end just before text[k]?"""
    a, b = text[k - 1], text[k]
    if b == " ":
        before, after = text[:k].rsplit(" ", 1)[-1], text[k + 1:].split(" ", 1)[0]
        return (a != " " and after != "" and not after[0].isdigit() and not a.isdigit()  # "rank 0", "50 ms", "64 个"
                and before not in OPERATORS and after not in OPERATORS)  # and so does "a + b"
    if a == " ":
        return False  # the break is at the space itself
    if b in CLOSING or a in OPENING or a == b == "—" or a == b == "…":
        return False
    if a == "、" and b.isdigit() and text[k - 2:k - 1].isdigit():
        return False  # "1、2、4、8" is one list
    if _wide(a) and _wide(b):
        return True
    return a in FULL_PUNCT or b in FULL_PUNCT  # one side narrow: only next to full-width punctuation


def _looks_special(tail: str) -> bool:
    """Would a line starting with `tail` read as a list item or a diagram on the next run, or open
    with an operator that belongs to the line before?"""
    return bool(MARKER.match(tail) or LEADING_ARROW.match(tail) or tail[0] in "【/=+×|")


def _join(head: str, tail: str) -> str:
    """`head` and `tail` as one line: a space between them unless both sides are CJK text or
    either side is full-width punctuation (how the blocks are written)."""
    a, b = head[-1], tail[0]
    if (_wide(a) and _wide(b)) or a in FULL_PUNCT or b in FULL_PUNCT:
        return head + tail
    return head + " " + tail


def wrap_text(text: str, blocks: list[Block], prefix: str, max_width: int) -> str:
    """`text` with the prose of every block rewrapped; code lines and diagram lines unchanged."""
    lines = text.splitlines()
    eol = "\r\n" if "\r\n" in text else "\n"  # the file's own line ending, kept
    for block in sorted(blocks, key=lambda b: b.start, reverse=True):
        lines[block.start:block.end - 1] = wrap_block(lines, block, prefix, max_width)
    return eol.join(lines) + (eol if text.endswith(("\n", "\r")) else "")
