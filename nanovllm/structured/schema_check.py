"""The full JSON schema, checked on a finished output where the grammar enforces less of it.

llguidance's grammar cannot express every JSON Schema keyword (`not`, `uniqueItems`,
`dependencies`, `if`/`then`/`else`, a `oneOf` it cannot prove exclusive, ...). Such a schema is
compiled leniently (those keywords left out of the grammar, `oneOf` as `anyOf`) and a
`SchemaCheck` of the whole schema goes with it: `StructuredOutput` asks it, wherever the grammar
would let the output end, whether the JSON so far satisfies the schema; if not, the output may
not end there, and where the grammar allows nothing else the request fails with the reason.
An output is never returned finished and invalid.
"""
# [ZH-START]
# 【模块定位】结构化输出的"事后校验"：语法表达不了的 JSON Schema 关键字（not、uniqueItems、
# dependencies、if/then/else、无法证明互斥的 oneOf……）按宽松方式编译（这些关键字不进语法，
# oneOf 当 anyOf），同时带上一个 SchemaCheck：StructuredOutput 在语法允许结束的位置用完整
# schema（jsonschema 库）校验已生成的 JSON；不满足就不许在那里结束，语法又别无可选时请求以
# 错误结束并说明原因。不会返回"已完成但不合 schema"的输出。
# [ZH-END]
from __future__ import annotations

import json
from typing import Any

MAX_CHECK_MESSAGE_CHARS = 300
"""Longest part of a validation message kept in a request's error (a value may be long)."""


class SchemaCheck:
    """A format's whole JSON schema, for the outputs its lenient grammar lets through."""
    # [ZH-START]
    # 【职责】持有一个 schema 的 jsonschema 校验器（按 $schema 选草案，默认 2020-12），
    #        和 llguidance 编译时的警告（语法没有强制的部分，写进错误信息里）；
    #        violation(text) 返回不满足的原因或 None。
    # 【边界】不编译语法、不碰 token：只看解码后的文本；校验器本身出错（Python 的 re
    #        不认的 pattern、解析不了的 $ref）也算不满足——没校验过的输出不放行。
    # 【协作者】compile_format 在宽松编译时创建；GrammarCache 随编译结果缓存；
    #        StructuredOutput 在语法可接受的位置调用 violation。
    # [ZH-END]

    def __init__(self, schema: Any, relaxed: list[str]):
        """`schema`: the format's JSON schema; `relaxed`: llguidance's warnings (what its grammar leaves out)."""
        import jsonschema

        cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
        self.validator = cls(schema)
        self.relaxed = relaxed

    def violation(self, text: bytes) -> str | None:
        """Why `text` (a complete JSON value by the grammar) does not satisfy the schema, or None."""
        from jsonschema.exceptions import best_match

        unenforced = "; ".join(self.relaxed)[:MAX_CHECK_MESSAGE_CHARS]
        try:
            value = json.loads(text)
            error = best_match(self.validator.iter_errors(value))
        except Exception as e:  # not JSON (cannot happen where the grammar accepts), or the check itself failed
            return (f"the output could not be checked against the schema ({type(e).__name__}: "
                    f"{str(e)[:MAX_CHECK_MESSAGE_CHARS]}); the grammar does not enforce: {unenforced}")
        if error is None:
            return None
        return (f"the output does not satisfy the schema at {error.json_path}: "
                f"{error.message[:MAX_CHECK_MESSAGE_CHARS]} (the grammar does not enforce: {unenforced})")
