"""The offline API: `LLM(model).generate(prompts, params)`, in-process, no ZeroMQ."""
from __future__ import annotations

import time

from tqdm.auto import tqdm

from nanovllm.config import Config
from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.models.tokenizer import load_tokenizer
from nanovllm.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str = "default", **config):
        self.engine = LLMEngine(Config(model=model, **config))
        self.tokenizer = load_tokenizer(self.engine.model_path)

    def generate(self, prompts: list[str] | list[list[int]], sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[dict]:
        """Generate for every prompt (text or token ids); results in prompt order."""
        if isinstance(prompts, (str, int)) or (prompts and isinstance(prompts[0], int)):
            raise TypeError("prompts must be a list of strings or a list of token-id lists")
        params = sampling_params or SamplingParams()
        if isinstance(params, list) and len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"offline-{i}" for i in range(len(prompts))]
        for request_id, prompt, p in zip(ids, prompts, params_list):
            tokens = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            self.engine.add_request(request_id, tokens, p)
        results: dict[str, list[int]] = {i: [] for i in ids}
        bar = tqdm(total=len(prompts), desc="Generating", dynamic_ncols=True, disable=not use_tqdm)
        start, produced = time.perf_counter(), 0
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                results[out.request_id].extend(out.new_token_ids)
                produced += len(out.new_token_ids)
                bar.update(int(out.finished))
            bar.set_postfix(output_tok_s=f"{produced / (time.perf_counter() - start):.0f}")
        bar.close()
        return [{"text": self.tokenizer.decode(results[i], skip_special_tokens=True), "token_ids": results[i]} for i in ids]
