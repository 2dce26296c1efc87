"""Token sampling for a whole batch at once, each row with its own parameters.

The model runner hands over the last-position logits (B, V) of every sequence that samples this
step. Per step, in this order:

1. logprobs (if asked) are read from the raw model distribution, before anything below;
2. penalties (repetition over prompt + output, presence / frequency over the output);
3. per-request constraints: logit_bias, EOS / stop tokens masked until `min_tokens`, and the
   request's logits processors (allowed ids, banned words, custom ones);
4. greedy rows take the argmax; the others divide by their temperature, keep their top_k, then
   the top_p nucleus and the tokens at least min_p times as likely as the best one (top_p and
   min_p are both judged on the top_k-renormalized distribution), and draw from what is left.
   The most likely token always survives the filters, and a temperature too small for float32
   acts as greedy.

Everything is tensor work over the batch; the only Python loops are over requests that have a
constraint or a seed. A batch of plain greedy requests is one argmax.

A row that cannot be sampled ends its own request, never the batch: if a logits processor raises,
the row holds NaN or +inf after penalties and constraints (or nothing but -inf), or the id
drawn is outside the vocabulary, the row's token is SAMPLE_FAILED and the reason is kept for
`take_error`. The engine finishes that request with reason "error"; the other rows are sampled
as they would be without it. Finding such rows costs the greedy fast path a read of B chosen
values, and the general path one max over the (B, V) logits.

Draws are by inverse CDF, one uniform number per row. Unseeded rows share the sampler's
generator; a seeded request takes its number from its own generator, and everything else its
draw depends on is computed row by row (neighbours only pad the candidate width with -inf), so
its tokens do not depend on which other requests share the batch. If a request's constraints
leave no token at all, its row is sampled without them (with a warning) rather than from an
empty set.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Sequence as Seq

import torch

from nanovllm.engine.sequence import Sequence
from nanovllm.layers.logits_processors import LogitsProcessor
from nanovllm.sampling_params import SamplingParams

_NEG_INF = float("-inf")
SAMPLE_FAILED = -1
"""The token id `Sampler.__call__` returns for a row that could not be sampled (see `take_error`)."""
MAX_ERROR_CHARS = 500
"""Longest error text kept for a request: a processor's exception message may be anything."""
log = logging.getLogger(__name__)


@dataclass(slots=True)
class TokenLogprobs:
    """Log-probabilities of one generated token under the raw model distribution."""
    token_id: int
    logprob: float
    rank: int
    """1 for the most likely token."""
    top_token_ids: list[int]
    top_logprobs: list[float]


@dataclass(slots=True)
class RequestState:
    """What the sampler keeps per request between steps."""
    params: SamplingParams
    processors: list[LogitsProcessor]
    min_tokens_blocked: torch.Tensor | None
    """EOS (unless ignore_eos) and stop token ids, masked while the output is shorter than min_tokens."""
    bias_ids: torch.Tensor | None
    bias_values: torch.Tensor | None
    generator: torch.Generator | None
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    """Computed but not yet reported by the engine."""
    error: str | None = None
    """Why the request's row could not be sampled, once it could not."""

    @property
    def plain_greedy(self) -> bool:
        p = self.params
        return p.is_greedy and not (p.has_penalties or self.processors or p.logprobs is not None
                                    or self.bias_ids is not None or p.min_tokens)


class Sampler:
    def __init__(self, vocab_size: int, device: torch.device, seed: int = 0):
        self.vocab_size = vocab_size
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)
        """Shared by requests without a seed."""
        self.states: dict[str, RequestState] = {}

    # -- per-request state ---------------------------------------------------------------------

    def add_request(self, request_id: str, params: SamplingParams, processors: list[LogitsProcessor] | None = None,
                    eos_token_ids: Seq[int] = ()) -> None:
        self.states[request_id] = self._new_state(params, processors or [], eos_token_ids)

    def remove_request(self, request_id: str) -> None:
        self.states.pop(request_id, None)

    def take_logprobs(self, request_id: str) -> list[TokenLogprobs] | None:
        """Logprobs computed since the last call, or None if the request did not ask for them."""
        state = self.states.get(request_id)
        if state is None or state.params.logprobs is None:
            return None
        out, state.logprobs = state.logprobs, []
        return out

    def take_error(self, request_id: str) -> str | None:
        """Why the request's last row came back as SAMPLE_FAILED, or None if it did not."""
        state = self.states.get(request_id)
        if state is None:
            return None
        out, state.error = state.error, None
        return out

    def _new_state(self, params: SamplingParams, processors: list[LogitsProcessor], eos_token_ids: Seq[int]) -> RequestState:
        dev = self.device
        blocked = list(params.stop_token_ids) + ([] if params.ignore_eos else list(eos_token_ids))
        bias = [(t, b) for t, b in params.logit_bias.items() if t < self.vocab_size]
        if len(bias) < len(params.logit_bias):
            raise ValueError(f"logit_bias has a token id outside the vocabulary [0, {self.vocab_size})")
        generator = None
        if params.seed is not None and not params.is_greedy:
            generator = torch.Generator(device=dev).manual_seed(params.seed)
        return RequestState(
            params, processors,
            torch.tensor([t for t in blocked if t < self.vocab_size], dtype=torch.long, device=dev) if params.min_tokens else None,
            torch.tensor([t for t, _ in bias], dtype=torch.long, device=dev) if bias else None,
            torch.tensor([b for _, b in bias], dtype=torch.float32, device=dev) if bias else None,
            generator,
        )

    def _state(self, seq: Sequence) -> RequestState:
        state = self.states.get(seq.request_id)
        if state is None:  # not added through the engine (a direct runner call): its params alone
            state = self.states[seq.request_id] = self._new_state(seq.params, [], ())
        return state

    # -- one step ------------------------------------------------------------------------------

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        """logits (B, V) float32, one row per sequence -> one token id per sequence.

        A row that could not be sampled gets SAMPLE_FAILED, and `take_error` says why.
        """
        states = [self._state(s) for s in seqs]
        if all(st.plain_greedy for st in states):
            return self._greedy(logits, seqs, states)  # no copies, no softmax, no random numbers
        logits = logits.float()
        failed: dict[int, str] = {}
        wants_logprobs = [i for i, st in enumerate(states) if st.params.logprobs is not None]
        raw_logprobs = torch.log_softmax(_rows(logits, wants_logprobs), dim=-1) if wants_logprobs else None  # (R, V)
        penalized = [i for i, st in enumerate(states) if st.params.has_penalties]
        if penalized:
            rows = apply_penalties_(_rows(logits, penalized), [seqs[i].token_ids for i in penalized],
                                    [seqs[i].output_token_ids for i in penalized],
                                    *_penalty_tensors([states[i].params for i in penalized], logits.device))
            if rows is not logits:
                logits[penalized] = rows
        self._constrain(logits, seqs, states, failed)
        if failed:  # sampled without the failed rows, so they cannot disturb the others
            good = [i for i in range(len(states)) if i not in failed]
            tokens = torch.full((len(states),), SAMPLE_FAILED, dtype=torch.long, device=logits.device)  # (B,)
            if good:
                tokens[good] = self._choose(logits[good], [states[i] for i in good])
        else:
            tokens = self._choose(logits, states)
        self._check_ids(tokens, failed)
        if raw_logprobs is not None:
            self._record_logprobs(raw_logprobs, wants_logprobs, tokens, states, failed)
        return self._report(tokens, seqs, states, failed)

    @staticmethod
    def _record_logprobs(raw_logprobs: torch.Tensor, rows: list[int], tokens: torch.Tensor, states: list[RequestState],
                         failed: dict[int, str]) -> None:
        """raw_logprobs (R, V) are the log-softmax of `rows`; each row that did not fail gets its entry."""
        keep = [j for j, i in enumerate(rows) if i not in failed]
        if len(keep) < len(rows):
            raw_logprobs, rows = raw_logprobs[keep], [rows[j] for j in keep]
        if rows:
            for i, lp in zip(rows, token_logprobs(raw_logprobs, tokens[rows], [states[i].params.logprobs for i in rows])):
                states[i].logprobs.append(lp)

    def _greedy(self, logits: torch.Tensor, seqs: list[Sequence], states: list[RequestState]) -> list[int]:
        tokens = logits.argmax(dim=-1)  # (B,)
        # argmax lands on a NaN or +inf when its row has one, and on -inf only when the row holds
        # nothing else: the B chosen values tell whether any row is non-finite.
        chosen = logits.gather(1, tokens.unsqueeze(1)).squeeze(1)  # (B,)
        ids = torch.where(torch.isfinite(chosen) & (tokens < self.vocab_size), tokens, SAMPLE_FAILED).tolist()
        if SAMPLE_FAILED not in ids:  # one device sync, as before the check
            return ids
        failed = {i: "the model's " + _non_finite(logits[i]) for i in (~torch.isfinite(chosen)).nonzero().flatten().tolist()}
        self._check_ids(tokens, failed)
        return self._report(tokens, seqs, states, failed)

    def _check_ids(self, tokens: torch.Tensor, failed: dict[int, str]) -> None:
        """Fail the rows whose token is outside [0, vocab_size) (logits wider than the vocabulary)."""
        outside = (tokens < 0) | (tokens >= self.vocab_size)  # (B,)
        if bool(outside.any()):
            for i in outside.nonzero().flatten().tolist():
                failed.setdefault(i, f"sampled token id {int(tokens[i])} is outside the vocabulary [0, {self.vocab_size})")

    @staticmethod
    def _report(tokens: torch.Tensor, seqs: list[Sequence], states: list[RequestState], failed: dict[int, str]) -> list[int]:
        ids = tokens.tolist()
        for i, error in failed.items():
            ids[i] = SAMPLE_FAILED
            states[i].error = error
            log.warning("request %s cannot be sampled: %s", seqs[i].request_id, error)
        return ids

    def _constrain(self, logits: torch.Tensor, seqs: list[Sequence], states: list[RequestState],
                   failed: dict[int, str]) -> None:
        """Apply each row's constraints; rows that fail them, or are left non-finite, go into `failed`."""
        maskable = [i for i, (seq, st) in enumerate(zip(seqs, states))
                    if st.processors or (st.min_tokens_blocked is not None and seq.num_output_tokens < st.params.min_tokens)]
        before = logits[maskable] if maskable else None  # (C, V) copy, to undo masks that leave nothing
        for i, (seq, st) in enumerate(zip(seqs, states)):
            error = self._apply_constraints(logits, i, seq, st)
            if error is not None:
                failed[i] = error
        best = logits.amax(dim=-1)  # (B,): NaN if the row has one, +inf if it has one, -inf if nothing is left
        if maskable:
            empty = [j for j in (best[maskable] == _NEG_INF).nonzero().flatten().tolist() if maskable[j] not in failed]
            if empty:
                rows = [maskable[j] for j in empty]
                log.warning("constraints of %s allow no token; sampling those rows unconstrained",
                            [seqs[i].request_id for i in rows])
                logits[rows] = before[empty]
                best[rows] = before[empty].amax(dim=-1)
        bad = ~torch.isfinite(best)
        if bool(bad.any()):
            for i in bad.nonzero().flatten().tolist():
                failed.setdefault(i, _non_finite(logits[i]) + " after penalties and constraints")

    @staticmethod
    def _apply_constraints(logits: torch.Tensor, i: int, seq: Sequence, st: RequestState) -> str | None:
        """Constrain row i in place; the error text if one of the request's processors failed."""
        if st.bias_ids is not None:
            logits[i].index_add_(0, st.bias_ids, st.bias_values)
        if st.min_tokens_blocked is not None and seq.num_output_tokens < st.params.min_tokens:
            logits[i].index_fill_(0, st.min_tokens_blocked, _NEG_INF)
        if st.processors:
            output = seq.output_token_ids
            row = logits[i]
            for processor in st.processors:
                try:
                    result = processor(output, row)
                    if result is not None and result is not row:
                        row.copy_(result)
                except Exception as e:  # custom processors run in-process: theirs is the request's failure
                    return f"logits processor {type(processor).__name__} raised {_exception_text(e)}"
        return None

    def _choose(self, logits: torch.Tensor, states: list[RequestState]) -> torch.Tensor:
        tokens = torch.empty(len(states), dtype=torch.long, device=logits.device)  # (B,)
        vocab = logits.shape[1]
        # Sampled rows go in two batches, with and without top-k/top-p/min-p, so plain-temperature
        # rows do not force a sort of the whole vocabulary on the filtered ones.
        greedy, plain, filtered = [], [], []
        for i, st in enumerate(states):
            (greedy if st.params.is_greedy else filtered if _filters(st.params, vocab) else plain).append(i)
        if greedy:
            tokens[greedy] = _rows(logits, greedy).argmax(dim=-1)
        for rows in (plain, filtered):
            if rows:
                tokens[rows] = sample_rows(_rows(logits, rows), [states[i].params for i in rows],
                                           [states[i].generator for i in rows], self.generator)
        return tokens


def _non_finite(row: torch.Tensor) -> str:
    """What is wrong with a row whose best value is not finite (rare: only failed rows get here)."""
    if bool(row.isnan().any()):
        return "logits hold NaN"
    if bool((row == float("inf")).any()):
        return "logits hold +inf"
    return "logits allow no token (all are -inf)"


def _exception_text(e: Exception) -> str:
    try:
        text = f"{type(e).__name__}: {e}"
    except Exception:  # its __str__ failed too
        text = type(e).__name__
    return text[:MAX_ERROR_CHARS]


def _rows(t: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """t[rows], without the copy when rows are all of t in order (the common case)."""
    return t if len(rows) == len(t) and rows[-1] == len(t) - 1 else t[rows]


def _filters(p: SamplingParams, vocab: int) -> bool:
    return 0 < p.top_k < vocab or p.top_p < 1 or p.min_p > 0


def sample_rows(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
                shared: torch.Generator) -> torch.Tensor:
    """Draw one token per row of logits (R, V) with each row's temperature and filters -> (R,).

    Each row takes one uniform number: from its own generator if it has one, else from `shared`.
    """
    vocab = logits.shape[1]
    finfo = torch.finfo(logits.dtype)
    # Clamped to the dtype's normal range: a temperature that rounds to 0 (1e-40 in float32) or
    # to inf would divide into inf or NaN. Each row's best logit is moved to 0 first, so a tiny
    # temperature sends it to 0 and every other token towards -inf: greedy, never NaN.
    temperature = torch.tensor([p.temperature for p in params], dtype=torch.float64, device=logits.device)
    temperature = temperature.clamp_(finfo.tiny, finfo.max).to(logits.dtype)
    scaled = (logits - logits.amax(dim=-1, keepdim=True)).div_(temperature.unsqueeze(1))  # (R, V)
    if any(_filters(p, vocab) for p in params):
        top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        candidates, ids = filter_candidates(scaled, top_k, [p.top_p for p in params], [p.min_p for p in params])
    else:
        candidates, ids = scaled, None
    uniform = torch.rand(len(params), dtype=torch.float64, device=logits.device, generator=shared)  # (R,)
    for j, g in enumerate(generators):
        if g is not None:
            uniform[j] = torch.rand(1, dtype=torch.float64, device=logits.device, generator=g)
    choice = draw(candidates, uniform)
    return choice if ids is None else ids.gather(1, choice.unsqueeze(1)).squeeze(1)


def _penalty_tensors(params: list[SamplingParams], device: torch.device) -> tuple[torch.Tensor, ...]:
    def col(name: str) -> torch.Tensor:
        return torch.tensor([getattr(p, name) for p in params], dtype=torch.float32, device=device)
    return col("repetition_penalty"), col("presence_penalty"), col("frequency_penalty")


def _padded(rows: list[list[int]], pad: int, device: torch.device) -> torch.Tensor:
    width = max(1, max(map(len, rows)))
    return torch.tensor([r + [pad] * (width - len(r)) for r in rows], dtype=torch.long, device=device)


def apply_penalties_(logits: torch.Tensor, token_ids: list[list[int]], output_ids: list[list[int]],
                     repetition: torch.Tensor, presence: torch.Tensor, frequency: torch.Tensor) -> torch.Tensor:
    """Penalize logits (R, V) in place; `token_ids` are each row's prompt + output tokens.

    repetition (HF / vLLM): a token seen in the prompt or output has a positive logit divided by
    the penalty and a negative one multiplied by it. presence / frequency (OpenAI): a token that
    occurs c > 0 times in the output loses `presence + c * frequency`. Work is proportional to
    the tokens seen, not to the vocabulary.
    """
    dev = logits.device
    # Pad with each row's own first token: writing its penalized value twice changes nothing.
    seen = torch.tensor([ids + ids[:1] * (max(map(len, token_ids)) - len(ids)) for ids in token_ids], device=dev)  # (R, L)
    values = logits.gather(1, seen)
    rep = repetition.unsqueeze(1)
    logits.scatter_(1, seen, torch.where(values > 0, values / rep, values * rep))
    if not any(output_ids) or not bool(((presence != 0) | (frequency != 0)).any()):
        return logits
    vocab = logits.shape[1]
    out = _padded(output_ids, vocab, dev).sort(dim=-1).values  # (R, Lo); pads (= vocab) sort last
    real = out < vocab
    first = real & torch.cat([torch.ones_like(real[:, :1]), out[:, 1:] != out[:, :-1]], dim=1)  # first of equal ids
    weight = -(frequency.unsqueeze(1) * real + presence.unsqueeze(1) * first)  # 0 on pads
    return logits.scatter_add_(1, out.clamp(max=vocab - 1), weight)


PROBE_WIDTH = 256
"""Tokens tried before a full sort when a row has top_p / min_p but no top_k (a cost choice only)."""


def filter_candidates(logits: torch.Tensor, top_k: list[int], top_p: list[float],
                      min_p: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """Temperature-scaled logits (R, V) -> candidate logits and their token ids, both (R, W).

    Candidates are sorted most likely first and W is the largest top_k of the rows. Entries
    outside a row's top_k / top_p / min_p set are -inf. Rows without a top_k first try the
    PROBE_WIDTH most likely tokens: when every such row's set ends inside them, the full sort of
    the vocabulary is skipped (the result is the same; only the cost differs).
    """
    vocab = logits.shape[1]
    width = max(top_k)
    if width == vocab and vocab > PROBE_WIDTH and all(k <= PROBE_WIDTH or k == vocab for k in top_k):
        probed = _filter(logits, *logits.topk(PROBE_WIDTH, dim=-1), top_k, top_p, min_p)
        if probed is not None:
            return probed
    values, ids = logits.topk(width, dim=-1) if width < vocab else logits.sort(dim=-1, descending=True)
    return _filter(logits, values, ids, top_k, top_p, min_p)


def _filter(logits: torch.Tensor, values: torch.Tensor, ids: torch.Tensor, top_k: list[int], top_p: list[float],
            min_p: list[float]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Mask sorted candidates (R, W); None if a row's set may extend past the W candidates."""
    dev, vocab, width = logits.device, logits.shape[1], values.shape[1]
    k = torch.tensor(top_k, device=dev).unsqueeze(1)
    values = values.masked_fill(torch.arange(width, device=dev).unsqueeze(0) >= k, _NEG_INF)
    p = torch.tensor(top_p, device=dev).unsqueeze(1)
    m = torch.tensor(min_p, device=dev).unsqueeze(1)
    # top_p is judged on the top_k-renormalized distribution: normalize over the row's top_k
    # candidates, or over the whole vocabulary when the row has no top_k.
    norm = values.logsumexp(dim=-1, keepdim=True)  # (R, 1)
    if max(top_k) == vocab:
        norm = torch.where(k < vocab, norm, logits.logsumexp(dim=-1, keepdim=True))
    probs = (values - norm).exp()  # (R, W)
    # Keep a token while the mass before it is short of top_p; rows with top_p == 1 skip the
    # test, since a rounded cumsum can reach 1 before the tail. min_p compares with the best.
    drop = ((probs.cumsum(dim=-1) - probs) >= p) & (p < 1)
    drop |= probs < m * probs[:, :1]
    drop[:, 0] = False  # the most likely token always stays, however small top_p (1e-50 rounds to 0)
    if width < vocab and not bool((drop[:, -1] | (k.squeeze(1) < vocab)).all()):
        return None  # a row without top_k keeps the last candidate: its set may go on past W
    return values.masked_fill(drop, _NEG_INF), ids


def draw(logits: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """One index per row of logits (R, W), with probability softmax(row), by inverse CDF -> (R,).

    `uniform` (R,) holds one number in [0, 1) per row: cheaper than noise per token, and a seeded
    generator advances by exactly one number per token whatever the row's width.
    """
    weights = (logits - logits.max(dim=-1, keepdim=True).values).exp_()  # (R, W); masked -> 0
    cdf = weights.cumsum(dim=-1, dtype=torch.float64)  # float64: exact enough over 150k tokens
    u = (1 - uniform).unsqueeze(1) * cdf[:, -1:]
    # u is in (0, total]: the first index whose cdf reaches u has a positive weight.
    return torch.searchsorted(cdf, u).squeeze(1)


def token_logprobs(logprobs: torch.Tensor, chosen: torch.Tensor, num_top: list[int]) -> list[TokenLogprobs]:
    """logprobs (R, V), chosen (R,) -> per row the chosen token's logprob, rank and top alternatives."""
    chosen_lp = logprobs.gather(1, chosen.unsqueeze(1))  # (R, 1)
    ranks = (logprobs > chosen_lp).sum(dim=-1) + 1
    n = max(num_top)
    top_lp, top_ids = logprobs.topk(n, dim=-1) if n else (logprobs[:, :0], chosen.new_empty(len(chosen), 0))
    rows = zip(chosen.tolist(), chosen_lp.squeeze(1).tolist(), ranks.tolist(), top_ids.tolist(), top_lp.tolist(), num_top)
    return [TokenLogprobs(t, lp, r, ids[:k], lps[:k]) for t, lp, r, ids, lps, k in rows]
