"""Keep docs/zh/walkthrough.md pointing at code that exists, with numbers the code produced.

The page names code as `path::Qualified.name` (a Python class or function, or a C function).
`--check` fails when a named file or name is gone; a line index (the section after INDEX_MARK)
that is no longer what `--write` would write is a warning, or a failure with `--strict` (line
numbers move with every edit elsewhere in a file, names should not). `--write` regenerates it.

`--trace` runs the page's request through the real pieces in one process, on the default model
(SmolLM2-135M-Instruct, float32 on the CPU, greedy): RequestBuilder, LLMEngine steps (each
step's batch as build_cpu_batch makes it), Output.encode_step, RequestStreams.step. It prints
`key = value` lines. The page shows them in blocks after TRACE_MARK lines (`--write` fills them
in); `--check-trace` runs the trace and fails where a block, or a `key = value` quoted in the
text, differs from what it printed.

    python scripts/zh_walkthrough.py --check [--strict] [DOC]
    python scripts/zh_walkthrough.py --write [DOC]
    python scripts/zh_walkthrough.py --trace
    python scripts/zh_walkthrough.py --check-trace [DOC]
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
TRACE_MARK = re.compile(r"<!-- zh_walkthrough trace: ([\w.]+) -->\n```text\n(.*?)```", re.S)
"""A generated block: the trace lines whose key starts with the marker's prefix."""
QUOTED = re.compile(r"`([a-z][\w.]*) = ([^`]+)`")
"""A `key = value` quoted in the page's text."""

WARM_PROMPT = "The capital of France is Paris. The capital of Japan is"
PROMPT = "The capital of France is Paris. The capital of Germany is Berlin. And the capital of Italy is"
BLOCK_SIZE = 8
STEP_TOKENS = 8  # max_num_batched_tokens: the 12 uncached prompt tokens take two steps
MAX_TOKENS = 3
CLIENT = b"walkthrough-cli"  # the client's routing id (zmq gives each connection one)


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


# -- the traced request ---------------------------------------------------------------------------

def _ids(values) -> str:
    """A list of ints, runs of consecutive ones written first..last."""
    values = [int(v) for v in values]
    if len(values) > 2 and values == list(range(values[0], values[0] + len(values))):
        return f"{values[0]}..{values[-1]}"
    return str(values)


def trace() -> list[str]:
    """Run the page's request; `key = value` lines, in the order the request meets the code."""
    if str(ROOT) not in sys.path:  # the stage packages, as the checkout has them
        sys.path.insert(0, str(ROOT))
    import torch

    from engine_proc.output import StepMessages
    from engine_proc.output import Output
    from detok_proc.streams import RequestStreams
    from nanovllm.config import Config
    from nanovllm.engine.llm_engine import LLMEngine
    from nanovllm.engine.step_input import StepInput, build_cpu_batch
    from nanovllm.metrics import DetokMetrics
    from nanovllm.models.tokenizer import load_tokenizer
    from nanovllm.sampling_params import SamplingParams
    from nanovllm_client import protocol as p
    from nanovllm_client.client_state import ClientState
    from prometheus_client import CollectorRegistry
    from tokenizer_proc.requests import RequestBuilder

    torch.manual_seed(0)
    engine = LLMEngine(Config(model="default", block_size=BLOCK_SIZE, max_num_batched_tokens=STEP_TOKENS,
                              num_kvcache_blocks=16, dtype="float32", device="cpu", num_threads=1))
    tokenizer = load_tokenizer(engine.model_path)
    bm = engine.block_manager
    lines = [f"block_size = {BLOCK_SIZE}", f"max_num_batched_tokens = {STEP_TOKENS}"]
    out = lines.append

    # The tokenizer stage's work: a GenerateReq in, a TokenizedReq frame out.
    builder = RequestBuilder(tokenizer)
    def generate_req(request_id: str, prompt: str, max_tokens: int) -> p.GenerateReq:
        return p.GenerateReq(request_id=request_id, prompt=prompt,
                             sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))

    def tokenized(request_id: str, prompt: str, max_tokens: int) -> p.TokenizedReq:
        return p.decode(builder.build(CLIENT, generate_req(request_id, prompt, max_tokens)))

    # An earlier request with the same first block: its K/V is in the prefix cache when ours comes.
    warm = tokenized("warm", WARM_PROMPT, 1)
    engine.add_request(warm.request_id, p.unpack_token_ids(warm.prompt_token_ids), warm.sampling)
    while engine.has_unfinished_requests():
        engine.step()
    out(f"warm.num_tokens = {len(p.unpack_token_ids(warm.prompt_token_ids))}")
    out(f"warm.cached_blocks = {sorted(bm.hash_to_block_id.values())}")

    client = ClientState()  # the client's side: frames in, each stream's deltas out
    client.sent("req-1", generate_req("req-1", PROMPT, MAX_TOKENS).encode())
    req = tokenized("req-1", PROMPT, MAX_TOKENS)
    ids = p.unpack_token_ids(req.prompt_token_ids)
    out(f"request.engine_id = {req.request_id}")
    out(f"request.num_tokens = {len(ids)}")
    out(f"request.token_ids = {ids}")
    out(f"request.first_block = {ids[:BLOCK_SIZE]} {tokenizer.decode(ids[:BLOCK_SIZE])!r}")
    out(f"request.meta.prompt_tail = {p.unpack_token_ids(req.meta.prompt_tail)}")

    hits: list[list[int]] = []
    match_prefix = bm.match_prefix
    bm.match_prefix = lambda seq: hits.append(match_prefix(seq)) or hits[-1]  # watched, not changed
    batches: list[tuple] = []
    run = engine.runner.run

    def watched_run(scheduled, previous=None):
        step = StepInput.from_scheduled(scheduled)
        batches.append((step, build_cpu_batch(step, BLOCK_SIZE, torch_attention=False)))
        return run(scheduled, previous)
    engine.runner.run = watched_run

    # The engine stage's work: add, step; each step's outputs as a StepOutput frame for the detokenizer.
    engine.add_request(req.request_id, ids, req.sampling)
    seq = engine.requests[req.request_id]
    output = Output(None, "engine-1", lambda: None, 1.0)
    streams = RequestStreams(tokenizer, DetokMetrics(CollectorRegistry()))
    started = [p.StartedRow(request_id=req.request_id, meta=req.meta)]
    text = ""
    usage = None
    n = 0
    while engine.has_unfinished_requests():
        n += 1
        key = f"step{n}"
        outputs = engine.step()
        step, (input_ids, positions, meta) = batches[-1]
        if n == 1:
            out(f"{key}.prefix_hits = {hits[-1]}")
            out(f"{key}.num_cached_tokens = {seq.num_cached_tokens}")
        if meta.num_decode:
            out(f"{key}.kind = decode")
            out(f"{key}.input_ids = {input_ids.tolist()}")
            out(f"{key}.block_table = {step.decode_block_tables[0]}")
            out(f"{key}.context_lens = {meta.decode_context_lens.tolist()}")
        else:
            span = meta.prefills[0]
            out(f"{key}.kind = prefill chunk")
            out(f"{key}.block_table = {step.prefill_block_tables[0]}")
            out(f"{key}.context_len = {span.num_cached + span.q_len}")
        out(f"{key}.positions = {_ids(positions)}")
        out(f"{key}.slot_mapping = {_ids(meta.slot_mapping)}")
        out(f"{key}.sample_rows = {step.sample_rows}")
        if seq.is_finished:  # its blocks went back to the free list; the hashed ones stay findable
            table = (step.decode_block_tables or step.prefill_block_tables)[0]
            out(f"{key}.freed_blocks = {table}")
            out(f"{key}.cached_blocks = {sorted(bm.hash_to_block_id.values())}")
        else:
            out(f"{key}.num_computed_tokens = {seq.num_computed_tokens}")
            out(f"{key}.hashed_blocks = {[b for b in seq.block_table if bm.blocks[b].hash is not None]}")
        mine = [o for o in outputs if o.request_id == req.request_id]
        if not mine:
            out(f"{key}.output = none")
            continue
        frames = output.encode_step(StepMessages(started=started, outputs=mine))
        started = []
        row = p.decode(frames[0]).outputs[0]
        new = p.unpack_token_ids(row.token_ids)
        out(f"{key}.sampled = {new} {tokenizer.decode(new)!r}")
        out(f"{key}.output_row = token_ids={new} finished={row.finished} finish_reason={row.finish_reason} "
            f"num_prompt_tokens={row.num_prompt_tokens} num_output_tokens={row.num_output_tokens} "
            f"num_cached_tokens={row.num_cached_tokens}")
        deltas = [d for frame in frames for d in streams.step(p.decode(frame)).deltas.get(CLIENT, [])]
        for delta in deltas:
            out(f"{key}.delta = request_id={delta.request_id} text={delta.text!r} finish_reason={delta.finish_reason}")
        for delta in client.handle(p.StreamOutput(deltas=deltas).encode()).deltas:  # as the detokenizer sends them
            text += delta.text
            usage = delta.usage or usage
    out(f"client.text = {text!r}")
    out(f"client.usage = {usage}")
    engine.runner.close()
    return lines


def check_trace(text: str, lines: list[str]) -> list[str]:
    """Where the page's trace blocks and quoted `key = value`s differ from the trace `lines`."""
    values = dict(line.split(" = ", 1) for line in lines)
    problems = []
    for prefix, block in TRACE_MARK.findall(text):
        want = "".join(f"{line}\n" for line in lines if line.startswith(prefix + "."))
        if block != want:
            problems.append(f"trace block {prefix!r} differs from the trace:\n{block}--- the trace prints ---\n{want}")
    for key, value in QUOTED.findall(text):
        if key in values and values[key] != value:
            problems.append(f"`{key} = {value}` in the text; the trace prints {values[key]!r}")
    return problems


def fill_trace(text: str, lines: list[str]) -> str:
    """The page with every trace block replaced by what the trace printed."""
    def block(m: re.Match) -> str:
        body = "".join(f"{line}\n" for line in lines if line.startswith(m.group(1) + "."))
        return f"<!-- zh_walkthrough trace: {m.group(1)} -->\n```text\n{body}```"
    return TRACE_MARK.sub(block, text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", action="store_true")
    mode.add_argument("--write", action="store_true")
    mode.add_argument("--trace", action="store_true", help="run the request and print its numbers")
    mode.add_argument("--check-trace", action="store_true", help="the page's numbers equal the trace's")
    parser.add_argument("--strict", action="store_true", help="with --check: an out-of-date line index fails")
    parser.add_argument("doc", nargs="?", type=Path, default=DOC)
    args = parser.parse_args(argv)
    if args.trace:
        print("\n".join(trace()))
        return 0
    text = args.doc.read_text(encoding="utf-8")
    if args.check_trace:
        problems = check_trace(text, trace())
        for p in problems:
            print(f"{args.doc}: {p}", file=sys.stderr)
        if problems:
            print(f"{args.doc}: run python scripts/zh_walkthrough.py --write", file=sys.stderr)
            return 1
        print(f"{args.doc}: every trace block and quoted number matches the trace")
        return 0
    if args.write:
        text = fill_trace(text, trace())
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
