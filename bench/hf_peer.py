"""HF transformers as a peer on the benchmark weights: batch-1 decode latency at its fastest, and
plain `generate` throughput on nano-vllm's offline workload.

Decode latency follows the gpt-fast recipe: a static KV cache, the one-token decode forward (argmax
included) under `torch.compile(mode="reduce-overhead", fullgraph=True)`, which on CUDA replays it
as a CUDA graph. The prompt is prefilled once, eagerly; then every decode step feeds the last
token, the cache placing it (transformers 5 has no `cache_position`: a static cache counts its own
tokens on the device). Each step is timed to a device synchronisation; the median is reported. If
compiling fails the eager forward is timed instead, and the JSON says `compiled: false` and why.

Throughput is what `generate` gives out of the box (dynamic cache, no compile): bench/offline.py's
requests (the same prompts and output lengths for the same arguments), EOS ignored. `generate`
runs a padded batch to one length, so requests are sorted by output length, batched (left padding)
and each batch runs to its longest output; `offline_output_tok_s` counts only the tokens the
requests asked for, `offline_generated_tokens` also the overshoot. Decode and throughput each run
in a fresh process. Prints one JSON line, then a table.

    python -m bench.hf_peer --shape qwen3-0.6b --model-dir DIR          # on a GPU
    python -m bench.hf_peer --shape tiny --device cpu --no-compile --num-seqs 8 --max-input 64 --max-output 32

Budget (Qwen3-0.6B shape on one H100, estimated, not measured): the compiled decode costs about a
minute of compiling and recording, then ~2 ms a step, so 128 timed steps after 16 warm-up ones are
noise. Eager `generate` is bound by Python at roughly 20-25 ms a step for 28 layers at batch 64
(the dynamic cache copies itself each step too), so the offline part costs about 22 ms per step of
the batches' longest outputs: the default 128 requests, in two batches of 64, run 607 + 1023
steps, about 35 s; the 256 of bench/offline.py's GPU run would take 2802 steps, about 60 s,
which with the compile and two model loads comes too near 2.5 minutes. Hence `--num-seqs 128` by
default: the first 128 of bench/offline.py's 256 requests (prompts and output lengths are drawn in
order), so `--num-seqs 256` gives exactly its workload.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import time

import torch

from bench.models import add_model_flags, make_bench_model
from bench.offline import in_fresh_process, make_workload, random_output_lengths

WARM_UP_STEPS = 16
"""Decode steps before timing: CUDA graph trees compile on the first call, record on a later one,
and replay only after that."""


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """"auto" is what nanovllm makes of a float32 checkpoint on CUDA (bfloat16) and on a CPU
    without native bf16 (float32)."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def load_hf_model(path: str, device: torch.device, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()


def prefill(model, prompt: torch.Tensor, cache) -> torch.Tensor:
    """The prompt (1, P) into `cache`; the greedy next token, (1, 1)."""
    logits = model(input_ids=prompt, cache=cache, use_cache=True, logits_to_keep=1).logits  # (1, 1, vocab)
    return logits[:, -1].argmax(dim=-1, keepdim=True)


def decode_step(model, token: torch.Tensor, cache) -> torch.Tensor:
    """One token (1, 1) through the model at the cache's next position; the greedy next token."""
    logits = model(input_ids=token, cache=cache, use_cache=True).logits  # (1, 1, vocab)
    return logits[:, -1].argmax(dim=-1, keepdim=True)


def timed_decode(model, step, cache, prompt: torch.Tensor, steps: int, graphed: bool) -> list[float]:
    """Seconds of each of `steps` decode steps after prefilling `prompt` into the emptied cache."""
    cache.reset()  # in place: a compiled step holds the cache tensors' addresses
    token = prefill(model, prompt, cache)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        if graphed:  # the previous step's outputs are dead: the next replay may reuse their memory
            torch.compiler.cudagraph_mark_step_begin()
        token = step(token, cache).clone()  # cloned: a graph replay overwrites its output in place
        synchronize(prompt.device)
        times.append(time.perf_counter() - start)
    return times


def decode_worker(path: str, device: str, dtype: str, prompt_len: int, steps: int, compile_step: bool,
                  seed: int) -> dict:
    """Batch-1 decode latency (run in a fresh process by `main`)."""
    from transformers import StaticCache

    dev = resolve_device(device)
    model = load_hf_model(path, dev, resolve_dtype(dtype, dev))
    prompt = torch.tensor(make_workload(1, prompt_len, prompt_len, model.config.vocab_size, seed), device=dev)  # (1, P)
    cache = StaticCache(config=model.config, max_cache_len=prompt_len + steps)
    eager = functools.partial(decode_step, model)
    step, not_compiled = eager, "--no-compile"
    if compile_step:
        step, not_compiled = torch.compile(eager, mode="reduce-overhead", fullgraph=True), None
    start = time.perf_counter()
    with torch.inference_mode():
        try:
            timed_decode(model, step, cache, prompt, min(steps, WARM_UP_STEPS), graphed=step is not eager)
        except Exception as e:  # noqa: BLE001 - any failure of the compiled path: time the eager one
            step, not_compiled = eager, f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:300]}"
            timed_decode(model, step, cache, prompt, min(steps, WARM_UP_STEPS), graphed=False)
        warm_up_s = time.perf_counter() - start
        times = timed_decode(model, step, cache, prompt, steps, graphed=step is not eager)
    median = statistics.median(times)
    # A compiled step that could not be captured runs as plain kernels, and only a log line says so.
    graph_skips = _inductor_counter("cudagraph_skips") if step is not eager and dev.type == "cuda" else None
    return {"compiled": step is not eager, "not_compiled_reason": not_compiled, "cuda_graph_skips": graph_skips,
            "decode_warm_up_s": round(warm_up_s, 1), "decode_ms_batch1": round(1e3 * median, 3),
            "decode_mean_ms": round(1e3 * statistics.fmean(times), 3), "decode_tok_s": round(1 / median, 1)}


def _inductor_counter(name: str) -> int:
    from torch._dynamo.utils import counters

    return int(counters["inductor"][name])


def left_padded(prompts: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids and attention_mask, (B, longest), padded on the left with token 0."""
    longest = max(map(len, prompts))
    ids = torch.zeros(len(prompts), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, longest - len(prompt):] = torch.tensor(prompt)
        mask[row, longest - len(prompt):] = 1
    return ids.to(device), mask.to(device)


def generate_in_batches(model, prompts: list[list[int]], output_lens: list[int], batch_size: int) -> int:
    """Every request through `generate`, batched by output length; the tokens generated, each
    batch's overshoot past its shorter requests included."""
    order = sorted(range(len(prompts)), key=lambda i: output_lens[i])
    generated = 0
    for first in range(0, len(order), batch_size):
        batch = order[first:first + batch_size]
        ids, mask = left_padded([prompts[i] for i in batch], model.device)
        new_tokens = max(output_lens[i] for i in batch)
        # min_new_tokens = max_new_tokens: EOS never ends a row early, as ignore_eos in nanovllm.
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        generated += (out.shape[1] - ids.shape[1]) * len(batch)
    return generated


def offline_worker(path: str, device: str, dtype: str, prompts: list[list[int]], output_lens: list[int],
                   batch_size: int) -> dict:
    """`generate` throughput (run in a fresh process by `main`)."""
    dev = resolve_device(device)
    model = load_hf_model(path, dev, resolve_dtype(dtype, dev))
    with torch.inference_mode():
        generate_in_batches(model, [p[:16] for p in prompts[:2]], [4, 4], batch_size)  # warm-up
        synchronize(dev)
        start = time.perf_counter()
        generated = generate_in_batches(model, prompts, output_lens, batch_size)
        synchronize(dev)
        seconds = time.perf_counter() - start
    requested = sum(output_lens)
    return {"offline_s": round(seconds, 3), "offline_output_tok_s": round(requested / seconds, 1),
            "offline_requested_tokens": requested, "offline_generated_tokens": generated,
            "offline_generated_tok_s": round(generated / seconds, 1)}


OFFLINE_FIELDS = ("offline_s", "offline_output_tok_s", "offline_requested_tokens", "offline_generated_tokens",
                  "offline_generated_tok_s")
DECODE_FIELDS = ("compiled", "not_compiled_reason", "cuda_graph_skips", "decode_warm_up_s", "decode_ms_batch1",
                 "decode_mean_ms", "decode_tok_s")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_flags(ap, dtype_help="auto: bfloat16 on CUDA, float32 on CPU")
    only = ap.add_mutually_exclusive_group()
    only.add_argument("--decode-only", action="store_true", help="batch-1 decode latency only")
    only.add_argument("--offline-only", action="store_true", help="generate throughput only")
    ap.add_argument("--prompt-len", type=int, default=128, help="prompt tokens before the timed decode steps")
    ap.add_argument("--decode-steps", type=int, default=128, help="timed decode steps")
    ap.add_argument("--no-compile", action="store_true", help="time the eager decode forward")
    ap.add_argument("--num-seqs", type=int, default=128, help="offline requests (the docstring says why not 256)")
    ap.add_argument("--min-input", type=int, default=100)
    ap.add_argument("--max-input", type=int, default=1024)
    ap.add_argument("--min-output", type=int, default=100)
    ap.add_argument("--max-output", type=int, default=1024)
    ap.add_argument("--batch-size", type=int, default=64, help="requests per generate call")
    ap.add_argument("--seed", type=int, default=0, help="of the prompts (0: bench/offline.py's timed run)")
    args = ap.parse_args(argv)
    for name in ("prompt_len", "decode_steps", "num_seqs", "min_input", "min_output", "batch_size"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    for low, high in (("min_input", "max_input"), ("min_output", "max_output")):
        if getattr(args, low) > getattr(args, high):
            ap.error(f"--{low.replace('_', '-')} ({getattr(args, low)}) is above "
                     f"--{high.replace('_', '-')} ({getattr(args, high)})")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    path = make_bench_model(args.shape, args.model_dir)
    vocab = json.load(open(os.path.join(path, "config.json")))["vocab_size"]
    result = {"bench": "hf_peer", "shape": args.shape, "device": device_name(device),
              "dtype": str(dtype).removeprefix("torch."), "transformers": _transformers_version(),
              "prompt_len": args.prompt_len, "decode_steps": args.decode_steps, **dict.fromkeys(DECODE_FIELDS),
              "num_seqs": args.num_seqs, "batch_size": args.batch_size, "input_range": [args.min_input, args.max_input],
              "output_range": [args.min_output, args.max_output], **dict.fromkeys(OFFLINE_FIELDS)}
    if not args.offline_only:
        result.update(in_fresh_process(decode_worker, path, device.type, result["dtype"], args.prompt_len,
                                       args.decode_steps, not args.no_compile, args.seed))
    if not args.decode_only:
        prompts = make_workload(args.num_seqs, args.min_input, args.max_input, vocab, args.seed)
        output_lens = random_output_lengths(args.min_output, args.max_output, args.num_seqs)
        result.update(in_fresh_process(offline_worker, path, device.type, result["dtype"], prompts, output_lens,
                                       args.batch_size))
    print(json.dumps(result))
    print_table(result)
    return result


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def print_table(r: dict) -> None:
    print(f"\nhf transformers {r['transformers']} on {r['device']}, {r['dtype']}, shape {r['shape']}")
    if r["decode_ms_batch1"] is not None:
        how = "compiled, static cache" if r["compiled"] else f"eager, static cache ({r['not_compiled_reason']})"
        if r["cuda_graph_skips"]:
            how += f", {r['cuda_graph_skips']} CUDA graph skips (see the log)"
        print(f"{'decode batch 1':<16}{r['decode_ms_batch1']:>10.2f} ms/token {r['decode_tok_s']:>10.1f} tok/s   {how}")
    if r["offline_s"] is not None:
        print(f"{'generate':<16}{r['offline_output_tok_s']:>10.1f} out tok/s ({r['offline_requested_tokens']} "
              f"requested tokens in {r['offline_s']:.2f} s; {r['offline_generated_tokens']} generated, "
              f"{r['num_seqs']} requests in batches of {r['batch_size']})")


if __name__ == "__main__":
    main()
