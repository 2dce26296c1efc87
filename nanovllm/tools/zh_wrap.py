"""Rewrap the prose lines of Chinese annotation blocks to a width (`zh_comments wrap`).

A line over the width is broken at the last point that fits: a space outside a `code span`, or
between two wide characters (CJK text, full-width punctuation), never before closing punctuation
（，。、；：）」 and the like) nor after opening punctuation, never inside an ASCII word. What does
not fit moves to the front of the paragraph's next line, or onto a new line at the paragraph's
hanging indent, so the author's other breaks stay where they are. A paragraph is a line and the
lines after it at its hanging indent, up to a line that ends a sentence. Diagram lines are left
to a human: box-drawing characters, a leading arrow, aligned columns (three spaces inside a
line), anything inside a ``` fence, and lines indented deeper than any open list item.
Only whitespace at the break points changes; a second run changes nothing.
"""
from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass

from nanovllm.tools.zh_blocks import Block, display_width

CLOSING = set("，。、；：？！）」』》】〉”’…—～·,.;:?!)]}%")
"""Characters a line must not start with: they close or end what comes before them."""
OPENING = set("（「『《【〈“‘([{")
"""Characters a line must not end with: they open what comes after them."""
FULL_PUNCT = set("，。、；：？！（）「」『』《》【】〈〉“”‘’…—～·")
SENTENCE_END = ("。", "！", "？", "；", "：", ".", "!", "?", ";", ":")
DIAGRAM = re.compile(r"[\u2500-\u259f\u25b2-\u25c4\u25bc\u25be]")  # box drawing, blocks, ▲▶▼◀
LEADING_ARROW = re.compile(r"(->|<-|=>|→|←|↑|↓|⇒|⇐|↔|\||\+-|`{3})")
MARKER = re.compile(r"(\d+\.|[a-z]\.|[-*•]|\(\d+\)|（\d+）)\s+")
"""A list item's marker and the spaces after it: continuation lines hang under its text."""
NEAR = 12
SHORT = 20


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
    open_indents = [0]  # where a plain line may start: the left edge and the open list items' text
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
        if marker:
            open_indents = [k for k in open_indents if k <= indent] + [indent + marker.end()]
        before = parsed[-1] if parsed else None
        verbatim = (fenced or bool(DIAGRAM.search(text)) or bool(LEADING_ARROW.match(text)) or "   " in text
                    or (not marker and indent not in open_indents))
        joins = (not verbatim and not marker and not text.startswith("【") and before is not None
                 and not before.verbatim and indent == before.hanging and not before.text.endswith(SENTENCE_END))
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
    ("text", "") when it fits or has no break point that fits. A break at a space or after
    punctuation is preferred to one inside a run of CJK text when it costs at most NEAR columns;
    on a paragraph's `last` line, one that leaves at least SHORT columns on the new line is."""
    if display_width(text) <= width:
        return text, ""
    found: list[tuple[str, str, int, bool]] = []  # (head, tail, head's width, at a space or punctuation)
    used, in_code = 0, False
    for k, c in enumerate(text):
        if k and _may_break(text, k, in_code):
            head, tail = text[:k].rstrip(" "), text[k:].lstrip(" ")
            if head and tail and not _looks_special(tail):
                found.append((head, tail, used, c == " " or text[k - 1] in FULL_PUNCT))
        if c == "`":
            in_code = not in_code
        used += 2 if _wide(c) else 1
        if used > width:
            break
    if last:
        total = display_width(text)
        found = [f for f in found if total - f[2] >= SHORT and f[2] >= width // 2] or found
    if not found:
        return text, ""
    good = [f for f in found if f[3]]
    best = good[-1] if good and good[-1][2] >= found[-1][2] - NEAR else found[-1]
    return best[0], best[1]


def _may_break(text: str, k: int, in_code: bool) -> bool:
    """May a line end just before text[k]?"""
    if in_code:
        return False
    a, b = text[k - 1], text[k]
    if b == " ":
        return a != " "
    if a == " ":
        return False  # the break is at the space itself
    if b in CLOSING or a in OPENING or a == b == "—" or a == b == "…":
        return False
    if _wide(a) and _wide(b):
        return True
    return a in FULL_PUNCT or b in FULL_PUNCT  # one side narrow: only next to full-width punctuation


def _looks_special(tail: str) -> bool:
    """Would a line starting with `tail` read as a list item or a diagram on the next run?"""
    return bool(MARKER.match(tail) or LEADING_ARROW.match(tail) or tail.startswith("【"))


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
    for block in sorted(blocks, key=lambda b: b.start, reverse=True):
        lines[block.start:block.end - 1] = wrap_block(lines, block, prefix, max_width)
    return "\n".join(lines) + ("\n" if text.endswith("\n") else "")
