"""The JSON schemas users send: a seeded sample of JSONSchemaBench through `response_format`.

    git clone https://github.com/guidance-ai/jsonschemabench      # the data: data/<subset>/*.json
    python -m bench.jsonschema_bench jsonschemabench/data [--sample 250] [--seed 0] [--max-tokens 192]
    python -m bench.jsonschema_bench jsonschemabench/data --compile [--every 1]

JSONSchemaBench (Geng et al., 2025) holds ~10k real-world schemas in folders by source: GitHub
(trivial to ultra), Kubernetes, Snowplow, WashingtonPost, JsonSchemaStore, Glaive. The data is
not kept in this repository: pass the folder of a clone.

The default run draws `--sample` schemas (random.Random(seed), over the sorted files of every
subset folder) and sends each as a `json_schema` response_format with a short chat prompt to
the offline engine on the default model, greedy, `--max-tokens` at most. Per subset it reports:
accepted (the format passed the shape and size checks and compiled), and of those finished
(`stop`), valid and invalid (the output checked against the whole schema with `jsonschema`;
`format` is an annotation there, as JSON Schema's default says), cut by length, and failed
(`error`: the schema check refused the output where the grammar allowed nothing else). Beside
it, as the peer in the same run, the earlier rule on the same schemas: 64 KiB of JSON at most
and a strict compile (every keyword enforced by the grammar, or refused).

`--compile` measures admission alone, no model: every `--every`-th schema of the whole data is
compiled as the engine does (`GrammarCache`: compile, matcher, first mask) and timed, with the
process's resident memory before and after (the growth one compiled schema holds), grouped by
the size of its JSON text: what sets `MAX_FORMAT_CHARS`.

Prints a table, then one JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import statistics
import time
from collections import Counter, defaultdict

OLD_LIMIT = 64 * 1024
"""The earlier limit on a format's JSON text, the peer's rule."""
SIZE_BUCKETS = [0, 4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20]


def schema_files(data: pathlib.Path) -> list[pathlib.Path]:
    files = sorted(data.glob("*/*.json"))
    if not files:
        raise SystemExit(f"no schemas under {data}: pass the data folder of a jsonschemabench clone")
    return files


def as_format(schema: object) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "schema", "schema": schema}}


def strict_accepts(fmt: dict, lltok) -> bool:
    """The earlier rule: at most OLD_LIMIT characters of JSON, and every keyword in the grammar."""
    import llguidance

    from nanovllm.structured import check_response_format, grammar_text

    try:
        check_response_format(fmt)
        return len(json.dumps(fmt)) <= OLD_LIMIT and not llguidance.LLMatcher.validate_grammar(grammar_text(fmt), lltok)
    except ValueError:
        return False


def prompt_for(path: pathlib.Path, schema: object, tokenizer) -> str:
    about = (schema.get("description") or schema.get("title")) if isinstance(schema, dict) else None
    text = f"Reply with one example JSON document for the schema {path.stem!r}."
    if isinstance(about, str) and about:
        text += f" It describes: {about[:200]}"
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)


def check_output(text: str, schema: object) -> str | None:
    """Why `text` is not a valid instance of `schema`, or None."""
    import jsonschema

    try:
        value = json.loads(text)
    except ValueError as e:
        return f"not JSON: {e}"
    try:
        cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
        error = jsonschema.exceptions.best_match(cls(schema).iter_errors(value))
    except Exception as e:  # the schema itself is beyond the validator
        return f"unchecked: {type(e).__name__}: {str(e)[:120]}"
    return None if error is None else f"{error.json_path}: {error.message[:120]}"


def generate(args) -> None:
    from nanovllm import LLM, SamplingParams

    files = schema_files(args.data)
    sample = random.Random(args.seed).sample(files, min(args.sample, len(files)))
    llm = LLM("default")
    while not llm.engine.compile_response_format({"type": "json_object"}):  # the vocabulary view loads
        time.sleep(0.1)
    lltok = llm.engine._grammars().lltok
    rows: dict[str, Counter] = defaultdict(Counter)
    refusals: Counter = Counter()
    prompts, params, meta = [], [], []
    start = time.perf_counter()
    for path in sample:
        subset = path.parent.name
        row = rows[subset]
        row["schemas"] += 1
        try:
            schema = json.loads(path.read_text(encoding="utf-8"))
        except ValueError:
            row["unreadable"] += 1
            continue
        fmt = as_format(schema)
        row["accepted_before"] += strict_accepts(fmt, lltok)
        try:
            p = SamplingParams(max_tokens=args.max_tokens, temperature=0, response_format=fmt)
            llm.engine.compile_response_format(p.response_format)
        except ValueError as e:
            refusals[str(e)[:90]] += 1
            continue
        row["accepted"] += 1
        prompts.append(prompt_for(path, schema, llm.tokenizer))
        params.append(p)
        meta.append((subset, schema))
    admission_s = time.perf_counter() - start
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    generate_s = time.perf_counter() - start
    invalid, failures = [], Counter()
    for out, (subset, schema) in zip(outs, meta):
        row = rows[subset]
        reason = out["finish_reason"]
        if reason == "stop":
            row["finished"] += 1
            why = check_output(out["text"], schema)
            row["valid" if why is None else "invalid"] += 1
            if why is not None:
                invalid.append({"subset": subset, "why": why, "text": out["text"][:200]})
        elif reason == "length":
            row["cut_by_length"] += 1
        else:
            row["failed"] += 1
            failures[(out.get("error") or reason)[:120]] += 1
    cols = ["schemas", "accepted_before", "accepted", "finished", "valid", "invalid", "cut_by_length", "failed"]
    total = Counter()
    for row in rows.values():
        total.update(row)
    print(f"{'subset':<16}" + "".join(f"{c:>16}" for c in cols))
    for name in sorted(rows) + ["all"]:
        row = total if name == "all" else rows[name]
        print(f"{name:<16}" + "".join(f"{row[c]:>16}" for c in cols))
    print(json.dumps({"bench": "jsonschema", "sample": len(sample), "seed": args.seed, "max_tokens": args.max_tokens,
                      "rows": {k: dict(v) for k, v in sorted(rows.items())}, "all": dict(total),
                      "refusals": refusals.most_common(), "failures": failures.most_common(), "invalid": invalid,
                      "admission_s": round(admission_s, 1), "generate_s": round(generate_s, 1),
                      "output_tokens": sum(len(o["token_ids"]) for o in outs),
                      "loadavg_after": os.getloadavg()}))


def compile_sizes(args) -> None:
    import psutil

    from nanovllm.models.tokenizer import load_tokenizer
    from nanovllm.structured import check_response_format, ll_tokenizer
    from nanovllm.structured.cache import GrammarCache

    tokenizer = load_tokenizer("default")
    lltok = ll_tokenizer(tokenizer, len(tokenizer))
    proc = psutil.Process()
    files = schema_files(args.data)[::args.every]
    buckets: dict[int, dict] = {lo: {"schemas": 0, "shape_refused": 0, "compiled": 0, "times": [], "rss": []}
                                for lo in SIZE_BUCKETS[:-1]}
    slowest = []
    for path in files:
        try:
            fmt = as_format(json.loads(path.read_text(encoding="utf-8")))
        except ValueError:
            continue
        size = len(json.dumps(fmt))
        b = buckets[max(lo for lo in SIZE_BUCKETS[:-1] if lo <= size)]
        b["schemas"] += 1
        try:
            check_response_format(fmt)
        except ValueError as e:  # depth is checked before size: a size refusal passed the rest
            if "characters of JSON" not in str(e):
                b["shape_refused"] += 1
                continue
        cache = GrammarCache(lltok)  # a fresh one: nothing cached
        rss = proc.memory_info().rss
        start = time.perf_counter()
        try:
            so = cache.structured(fmt)
            so.bits([])  # the first mask: llguidance builds lazily
        except ValueError:
            so = None
        elapsed = time.perf_counter() - start
        grew = proc.memory_info().rss - rss
        b["compiled"] += so is not None
        b["times"].append(elapsed)
        b["rss"].append(grew)
        slowest.append((elapsed, size, str(path.relative_to(args.data)), so is not None))
        del so, cache
    print(f"{'JSON size':>18} {'schemas':>8} {'refused (depth)':>16} {'compiled':>9} {'p50 ms':>8} {'max ms':>8} {'max RSS MiB':>12}")
    out = []
    for lo, hi in zip(SIZE_BUCKETS, SIZE_BUCKETS[1:]):
        b = buckets[lo]
        if not b["schemas"]:
            continue
        times = b.pop("times") or [0.0]
        rss = b.pop("rss") or [0]
        row = {"from": lo, "to": hi, **b, "p50_ms": round(1000 * statistics.median(times), 2),
               "max_ms": round(1000 * max(times), 1), "max_rss_mib": round(max(rss) / 2**20, 1)}
        out.append(row)
        print(f"{f'{lo >> 10}-{hi >> 10} KiB':>18} {row['schemas']:>8} {row['shape_refused']:>16} {row['compiled']:>9} "
              f"{row['p50_ms']:>8} {row['max_ms']:>8} {row['max_rss_mib']:>12}")
    slowest.sort(reverse=True)
    print(json.dumps({"bench": "jsonschema_compile", "every": args.every, "buckets": out,
                      "slowest": [{"s": round(s, 3), "chars": n, "file": f, "compiled": ok} for s, n, f, ok in slowest[:8]],
                      "loadavg_after": os.getloadavg()}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("data", type=pathlib.Path, help="the data folder of a jsonschemabench clone (data/<subset>/*.json)")
    ap.add_argument("--sample", type=int, default=250)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-tokens", type=int, default=192)
    ap.add_argument("--compile", action="store_true", help="measure compile time and memory by schema size instead")
    ap.add_argument("--every", type=int, default=1, help="with --compile: every N-th schema of the data")
    args = ap.parse_args()
    (compile_sizes if args.compile else generate)(args)


if __name__ == "__main__":
    main()
