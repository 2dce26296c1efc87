"""The offline API: `LLM(model).generate(prompts, params)`, in-process, no ZeroMQ."""
from __future__ import annotations

import time

from tqdm.auto import tqdm

from nanovllm.config import Config
from nanovllm.detokenize import IncrementalDetokenizer
from nanovllm.engine.heap import release_free_heap
from nanovllm.engine.llm_engine import LLMEngine, RequestOutput
from nanovllm.engine.policy import SchedulerPolicy
from nanovllm.models.tokenizer import load_tokenizer
from nanovllm.sampling_params import SamplingParams
from nanovllm_client.protocol import FinishReason


class LLM:
    def __init__(self, model: str = "default", scheduler_policy: str | SchedulerPolicy | None = None, **config):
        self.engine = LLMEngine(Config(model=model, **config), scheduler_policy=scheduler_policy)
        self.tokenizer = load_tokenizer(self.engine.model_path)
        release_free_heap()  # the tokenizer's load temporaries (engine/heap.py)

    def generate(self, prompts: list[str] | list[list[int]], sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: list[int] | None = None) -> list[dict]:
        """Generate for every prompt (text or token ids); results in prompt order.

        Each result has "text", "token_ids" and "finish_reason" (a `FinishReason`, equal to its
        string), plus "logprobs" (one `TokenLogprobs` per token) and "prompt_logprobs" (one per
        prompt token, the first with logprob 0) when asked for, and "error" (its
        text) when finish_reason is "error": that request's sampling failed, the others are
        unaffected. Stop strings
        end the text (kept only with `include_stop_str_in_output`); "token_ids" keeps every
        generated token.
        """
        if isinstance(prompts, (str, int)) or (prompts and isinstance(prompts[0], int)):
            raise TypeError("prompts must be a list of strings or a list of token-id lists")
        params = sampling_params or SamplingParams()
        if isinstance(params, list) and len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"got {len(priority)} priorities for {len(prompts)} prompts")
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"offline-{i}" for i in range(len(prompts))]
        results: dict[str, dict] = {}
        detoks: dict[str, IncrementalDetokenizer] = {}
        for i, (request_id, prompt, p) in enumerate(zip(ids, prompts, params_list)):
            tokens = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            self.engine.add_request(request_id, tokens, p, priority[i] if priority else 0)
            results[request_id] = {"token_ids": [], "finish_reason": None}
            if p.logprobs is not None:
                results[request_id]["logprobs"] = []
            if p.prompt_logprobs is not None:
                results[request_id]["prompt_logprobs"] = []
            if p.stop:
                detoks[request_id] = IncrementalDetokenizer(self.tokenizer, p, prompt_tail=tokens)
        bar = tqdm(total=len(prompts), desc="Generating", dynamic_ncols=True, disable=not use_tqdm)
        start, produced = time.perf_counter(), 0
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                self._collect(out, results[out.request_id], detoks.get(out.request_id))
                produced += len(out.new_token_ids)
                bar.update(int(out.finished))
            bar.set_postfix(output_tok_s=f"{produced / (time.perf_counter() - start):.0f}")
        bar.close()
        for request_id, p in zip(ids, params_list):
            r = results[request_id]
            detok = detoks.get(request_id)
            r["text"] = detok.text if detok and detok.stopped else \
                self.tokenizer.decode(r["token_ids"], skip_special_tokens=p.skip_special_tokens)
        return [results[i] for i in ids]

    def _collect(self, out: RequestOutput, result: dict, detok: IncrementalDetokenizer | None) -> None:
        result["token_ids"].extend(out.new_token_ids)
        if out.logprobs is not None:
            result["logprobs"].extend(out.logprobs)
        if out.prompt_logprobs is not None:
            result["prompt_logprobs"].extend(out.prompt_logprobs)
        if detok is not None and not detok.stopped:
            detok.add(out.new_token_ids, finished=out.finished)
            if detok.stopped:
                result["finish_reason"] = FinishReason.STOP
                if not out.finished:
                    self.engine.abort(out.request_id)  # its final (empty) output comes next step
        if out.finished and result["finish_reason"] is None:
            result["finish_reason"] = out.finish_reason
            if out.error is not None:
                result["error"] = out.error
