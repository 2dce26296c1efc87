"""Greedy tokens of nanovllm against HF transformers on the same weights, device and dtype.

K prompts of random token ids (lengths uniform in [min, max], seeded) go through nanovllm's offline
`LLM` in one batch, T greedy tokens each with EOS ignored; then HF runs its own greedy loop on each
prompt alone. Per prompt: equal, or the first position where the two differ and whether that is a
near-tie: HF's logits there (the prefix is still common) for HF's token and nanovllm's differ by at
most the tolerance, a difference rounding can flip. Each engine runs in a fresh process. Prints
one JSON line, then a table; exits 0 on a mismatch too (the `equal` field is the verdict).

    python -m bench.greedy_check --shape qwen3-0.6b --model-dir DIR        # on a GPU, bfloat16
    python -m bench.greedy_check --shape tiny --device cpu --dtype float32 --num-prompts 4 --tokens 16
"""
from __future__ import annotations

import argparse
import json
import os

import torch

from bench.hf_peer import device_name, load_hf_model, resolve_device, resolve_dtype
from bench.models import add_model_flags, make_bench_model
from bench.offline import in_fresh_process, make_workload

BF16_TOLERANCE = 0.05
"""The default near-tie tolerance in bfloat16, in logits; other dtypes scale it by their precision
(`default_tolerance`)."""


def default_tolerance(dtype: torch.dtype) -> float:
    """BF16_TOLERANCE scaled by the dtype's machine epsilon against bfloat16's: a gap of the same
    number of rounding steps (float16 ~0.006, float32 ~8e-7)."""
    return BF16_TOLERANCE * torch.finfo(dtype).eps / torch.finfo(torch.bfloat16).eps


def nanovllm_greedy(path: str, device: str, dtype: str, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    """nanovllm's greedy tokens for every prompt (run in a fresh process by `main`)."""
    from nanovllm import LLM, SamplingParams

    llm = LLM(path, dtype=dtype, device=device, max_num_seqs=len(prompts))
    try:
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True),
                               use_tqdm=False)
    finally:
        llm.engine.close()
    return [out["token_ids"] for out in outputs]


def hf_greedy_logits(model, prompt: list[int], tokens: int) -> tuple[list[int], torch.Tensor]:
    """HF's greedy tokens for one prompt, and the logits each was chosen from, (tokens, vocab) in
    float32."""
    ids = torch.tensor([prompt], device=model.device)  # (1, P)
    cache, chosen, logits = None, [], []
    for _ in range(tokens):
        out = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
        cache = out.cache
        step_logits = out.logits[0, -1].float()  # (vocab,)
        ids = step_logits.argmax().view(1, 1)
        chosen.append(ids.item())
        logits.append(step_logits)
    return chosen, torch.stack(logits)


def compare_with_hf(path: str, device: str, dtype: str, prompts: list[list[int]], nano_tokens: list[list[int]],
                    tokens: int, tolerance: float) -> list[dict]:
    """One row per prompt: HF's greedy tokens against nanovllm's (run in a fresh process by `main`)."""
    dev = resolve_device(device)
    model = load_hf_model(path, dev, resolve_dtype(dtype, dev))
    rows = []
    with torch.inference_mode():
        for prompt, nano in zip(prompts, nano_tokens):
            hf, logits = hf_greedy_logits(model, prompt, tokens)
            rows.append(compare_tokens(len(prompt), nano, hf, logits, tolerance))
    return rows


def compare_tokens(prompt_len: int, nano: list[int], hf: list[int], hf_logits: torch.Tensor, tolerance: float) -> dict:
    """Where nanovllm's tokens first leave HF's, and HF's logit gap between the two choices there."""
    row = {"prompt_len": prompt_len, "equal": nano == hf, "first_mismatch": None}
    if nano == hf:
        return row
    at = next((i for i, (a, b) in enumerate(zip(nano, hf)) if a != b), min(len(nano), len(hf)))
    if at == len(nano):  # nanovllm stopped short: nothing to weigh
        row.update(first_mismatch=at, nano_token=None, hf_token=hf[at], gap=None, near_tie=False)
        return row
    gap = (hf_logits[at, hf[at]] - hf_logits[at, nano[at]]).item()  # >= 0: HF's token is its argmax
    row.update(first_mismatch=at, nano_token=nano[at], hf_token=hf[at], gap=gap, near_tie=gap <= tolerance)
    return row


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_flags(ap, dtype_help="auto: bfloat16 on CUDA, float32 on CPU (both engines get the resolved one)")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--min-prompt-len", type=int, default=8)
    ap.add_argument("--max-prompt-len", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=32, help="greedy tokens compared per prompt")
    ap.add_argument("--tolerance", type=float, default=None,
                    help=f"near-tie logit gap (default {BF16_TOLERANCE} in bfloat16, scaled by precision otherwise)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    for name in ("num_prompts", "min_prompt_len", "tokens"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.min_prompt_len > args.max_prompt_len:
        ap.error(f"--min-prompt-len ({args.min_prompt_len}) is above --max-prompt-len ({args.max_prompt_len})")
    if args.tolerance is not None and args.tolerance < 0:
        ap.error(f"--tolerance must be at least 0, got {args.tolerance}")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    tolerance = default_tolerance(dtype) if args.tolerance is None else args.tolerance
    dtype_name = str(dtype).removeprefix("torch.")
    path = make_bench_model(args.shape, args.model_dir)
    vocab = json.load(open(os.path.join(path, "config.json")))["vocab_size"]
    prompts = make_workload(args.num_prompts, args.min_prompt_len, args.max_prompt_len, vocab, args.seed)
    nano = in_fresh_process(nanovllm_greedy, path, device.type, dtype_name, prompts, args.tokens)
    rows = in_fresh_process(compare_with_hf, path, device.type, dtype_name, prompts, nano, args.tokens, tolerance)
    result = {"bench": "greedy_check", "shape": args.shape, "device": device_name(device), "dtype": dtype_name,
              "tokens": args.tokens, "tolerance": tolerance,
              "equal": all(r["equal"] or r["near_tie"] for r in rows), "exact": all(r["equal"] for r in rows),
              "mismatches": sum(not r["equal"] for r in rows),
              "near_ties": sum(not r["equal"] and r["near_tie"] for r in rows), "prompts": rows}
    print(json.dumps(result))
    print_table(result)
    return result


def print_table(r: dict) -> None:
    print(f"\n{'prompt':>6}{'length':>8}  result")
    for i, row in enumerate(r["prompts"]):
        if row["equal"]:
            verdict = f"all {r['tokens']} tokens equal"
        else:
            kind = "near-tie" if row["near_tie"] else "MISMATCH"
            gap = "none (nanovllm stopped short)" if row["gap"] is None else f"{row['gap']:.4g}"
            verdict = (f"{kind} at token {row['first_mismatch']}: nanovllm {row['nano_token']}, hf {row['hf_token']}, "
                       f"hf logit gap {gap}")
        print(f"{i:>6}{row['prompt_len']:>8}  {verdict}")
    print(f"{r['device']}, {r['dtype']}: {'equal' if r['equal'] else 'NOT equal'} "
          f"({r['mismatches']} of {len(r['prompts'])} prompts differ, {r['near_ties']} of them at a near-tie "
          f"within {r['tolerance']:.3g})")


if __name__ == "__main__":
    main()
