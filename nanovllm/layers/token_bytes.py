"""The UTF-8 bytes each token id stands for, so text-level rules can be checked on token ids.

`banned_words` needs to know which next tokens would complete a banned string. Decoding tokens
one at a time loses bytes (a token may hold half a character), so the table is read from the
vocabulary itself: byte-level BPE (GPT-2, Qwen, SmolLM) maps 256 printable characters back to
bytes; SentencePiece-style vocabularies use "▁" for a space and "<0xNN>" for raw bytes. Special
tokens map to b"" (they are not text). Built once per engine, on first use.
"""
from __future__ import annotations

import json
import re
from typing import Any

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def byte_level_alphabet() -> dict[str, int]:
    """GPT-2's printable stand-in character for each byte -> the byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars = list(printable)
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(printable, chars)}


def _decoder_kind(tokenizer: Any) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return "other"
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    parts = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]
    kinds = {p.get("type") for p in parts}
    if "ByteLevel" in kinds:
        return "byte_level"
    if kinds & {"Metaspace", "ByteFallback", "Replace"}:
        return "metaspace"
    return "other"


def token_byte_table(tokenizer: Any, vocab_size: int) -> list[bytes]:
    """bytes of every token id in [0, vocab_size); ids the tokenizer lacks map to b""."""
    table = [b""] * vocab_size
    kind = _decoder_kind(tokenizer)
    alphabet = byte_level_alphabet()
    for piece, token_id in tokenizer.get_vocab().items():
        if token_id >= vocab_size:
            continue
        if kind == "byte_level" and all(c in alphabet for c in piece):
            table[token_id] = bytes(alphabet[c] for c in piece)
        elif kind == "metaspace":
            match = _BYTE_TOKEN.fullmatch(piece)
            table[token_id] = bytes([int(match.group(1), 16)]) if match else piece.replace("▁", " ").encode()
        elif kind == "other":
            table[token_id] = tokenizer.decode([token_id]).encode()
        else:
            table[token_id] = piece.encode()
    for token_id, added in getattr(tokenizer, "added_tokens_decoder", {}).items():
        if token_id < vocab_size:
            table[token_id] = b"" if added.special else added.content.encode()
    return table
