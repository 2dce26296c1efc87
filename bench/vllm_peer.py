"""vLLM's offline engine on one benchmark job: the peer that `bench/offline.py --vllm-python` runs.

Runs under vLLM's own virtualenv, in a fresh process, so it imports nothing from this repo. It
reads a JSON job on stdin, builds `vllm.LLM` on the model folder, warms up, times
`LLM.generate` once per prompt set and prints one JSON line:
{"runs": [[wall seconds, output tokens, CPU seconds], ...], "vllm": version}.

Job fields: model (folder), dtype, warm_up and prompt_sets (lists of token-id lists), output_lens (one per
request), sampling (temperature/top_p/top_k, or null for greedy), max_num_batched_tokens,
max_num_seqs, max_model_len (or null). The caller sets the environment (thread binding,
LD_PRELOAD, VLLM_CACHE_ROOT, VLLM_CPU_KVCACHE_SPACE, HF_HUB_OFFLINE).
"""
from __future__ import annotations

import json
import sys
import time

import psutil
import vllm
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt


def cpu_seconds() -> float:
    """CPU time of this process and its children: vLLM's engine core runs in a child process."""
    procs = [psutil.Process()] + psutil.Process().children(recursive=True)
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def timed_generate(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> tuple[float, int, float]:
    """(wall seconds, output tokens, CPU seconds) of one `generate` over all prompts at once."""
    requests = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    start, cpu = time.perf_counter(), cpu_seconds()
    outputs = llm.generate(requests, params, use_tqdm=False)
    wall, cpu = time.perf_counter() - start, cpu_seconds() - cpu
    return wall, sum(len(o.outputs[0].token_ids) for o in outputs), cpu


def sampling_params(output_len: int, sampling: dict | None) -> SamplingParams:
    # EOS ignored and min_tokens = max_tokens: every request produces exactly output_len tokens.
    knobs = sampling or {"temperature": 0.0}
    return SamplingParams(max_tokens=output_len, min_tokens=output_len, ignore_eos=True, detokenize=False, **knobs)


def main() -> None:
    job = json.load(sys.stdin)
    # No tokenizer: the bench models are bare weights and the prompts are token ids already.
    llm = LLM(model=job["model"], dtype=job["dtype"], skip_tokenizer_init=True,
              max_num_batched_tokens=job["max_num_batched_tokens"], max_num_seqs=job["max_num_seqs"],
              max_model_len=job["max_model_len"], seed=0)
    params = [sampling_params(n, job["sampling"]) for n in job["output_lens"]]
    timed_generate(llm, job["warm_up"], [sampling_params(16, None)] * len(job["warm_up"]))
    runs = [timed_generate(llm, prompts, params) for prompts in job["prompt_sets"]]
    print(json.dumps({"runs": runs, "vllm": vllm.__version__}), flush=True)


if __name__ == "__main__":
    main()
