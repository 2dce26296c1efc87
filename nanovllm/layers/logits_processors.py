"""Per-request output constraints: the `LogitsProcessor` interface and the two shipped ones.

A logits processor sees one request's next-token logits (V,) and the token ids it has generated
so far, and returns the logits to sample from (changing the row in place is fine). The sampler
calls each request's processors after penalties and before temperature / top-k / top-p, so a
token set to -inf here can never be drawn, greedy or not. A processor's decisions must depend on
`output_token_ids` alone: a preempted request is recomputed and must get the same decisions.
It may keep state derived from the output to save work (`BannedWords` does), as long as it
starts over when an output does not extend the one it saw last. A processor that raises, or
leaves NaN or +inf in the row, ends its own request with an error (the sampler's rule).

- `AllowedTokenIds`: only the listed tokens may be generated.
- `BannedTokenSequences`: token-id sequences that never appear in the output; a multi-token
  sequence is blocked at its last token, when the output already ends with the rest of it.
- `BannedWords`: strings that never appear in the output's bytes, however the model spells
  them in tokens: a token is blocked when it would complete the string (checked on the bytes
  of the tokens, see `token_bytes`). One Aho-Corasick automaton over the request's words
  follows the output, so a step costs the bytes of the new tokens, not the words' lengths.
"""
# [ZH-START]
# 【模块定位】每个请求自己的输出约束，在采样器内部运行：
#   模型执行器 → compute_logits → Sampler：惩罚项 →【logits processors】→ 温度 / top-k / top-p
#     → 抽样
# processor 看到一个请求的 logits (V,) 和它已生成的 token，返回（可原地修改的）logits；
# 在这里设为 -inf 的 token，greedy 与否都不会被选中。
# 决定只能依赖 output_token_ids：被抢占的请求会重算，必须得到同样的决定。
# 本文件提供三个内置 processor：AllowedTokenIds（白名单）、BannedTokenSequences（禁 token 序列）、
# BannedWords（禁字符串，按字节用 Aho-Corasick 自动机跟踪输出），由 build_logits_processors 按
# SamplingParams 组装；processor 抛异常或留下 NaN / +inf，只结束它自己的请求。
# [ZH-END]
from __future__ import annotations

import bisect
from collections import OrderedDict, deque
from typing import Callable, Protocol, Sequence

import torch

from nanovllm.sampling_params import SamplingParams
from nanovllm_client.checks import show

MAX_CACHED_WORDS = 4096
MAX_CACHED_MATCHERS = 256
"""Compiled word sets kept per vocabulary (requests often share one list of banned words)."""


class LogitsProcessor(Protocol):
    # [ZH-START]
    # 【职责】logits processor 的接口约定：(output_token_ids, logits (V,)
    # float32) → 要采样的 logits。
    # 【边界】只是 Protocol，不含实现；不得依赖输出以外的状态做决定。
    # 【协作者】constraints.apply_constraints 逐个调用；用户可通过 SamplingParams.logits_processors
    # 传入自己的实现（仅进程内）。
    # [ZH-END]
    def __call__(self, output_token_ids: Sequence[int], logits: torch.Tensor) -> torch.Tensor:
        """logits (V,) float32 of one request -> the logits to sample from."""
        ...


class AllowedTokenIds:
    # [ZH-START]
    # 【职责】只允许列出的 token：构造时建好 (V,) 的布尔 blocked 掩码（列出的为 False），
    # 每步一次 masked_fill_ 填 -inf。
    # 【边界】不检查 id 是否越界（build_logits_processors 已检查）；与输出内容无关，无状态。
    # 【协作者】由 build_logits_processors 根据 allowed_token_ids 创建，Sampler 每步调用。
    # [ZH-END]
    def __init__(self, token_ids: Sequence[int] | torch.Tensor, vocab_size: int, device: torch.device | str = "cpu"):
        self.blocked = torch.ones(vocab_size, dtype=torch.bool, device=device)
        self.blocked[torch.as_tensor(token_ids, dtype=torch.long).to(device)] = False

    def __call__(self, output_token_ids: Sequence[int], logits: torch.Tensor) -> torch.Tensor:
        return logits.masked_fill_(self.blocked, float("-inf"))


class BannedTokenSequences:
    # [ZH-START]
    # 【职责】禁止 token id 序列出现在输出里：单 token 序列永远屏蔽；多 token 序列在输出已以其前缀
    # 结尾时屏蔽最后一个 token。
    # 【边界】只处理 token id 序列，不管字符串（那是 BannedWords）；不保存状态，
    # 每步重新比较输出尾部。
    # 【协作者】由 build_logits_processors 根据 banned_words 里的 id 列表创建。
    # [ZH-END]
    def __init__(self, sequences: list[list[int]], device: torch.device | str = "cpu"):
        self.always = torch.tensor([s[0] for s in sequences if len(s) == 1], dtype=torch.long, device=device)
        self.longer = [(list(s[:-1]), s[-1]) for s in sequences if len(s) > 1]

    def __call__(self, output_token_ids: Sequence[int], logits: torch.Tensor) -> torch.Tensor:
        # [ZH-START]
        # 1. always 里的单 token 序列：index_fill_ 成 -inf。
        # 2. 对每个多 token 序列 (prefix, last)：输出长度 >= len(prefix) 且最后 len(prefix) 个 token
        #    等于 prefix，就把 logits[last] 设为 -inf。
        # 3. 每步代价与所有前缀长度之和成正比。
        # [ZH-END]
        logits.index_fill_(0, self.always, float("-inf"))
        for prefix, last in self.longer:
            n = len(prefix)
            if len(output_token_ids) >= n and list(output_token_ids[-n:]) == prefix:
                logits[last] = float("-inf")
        return logits


class WordIndex:
    """For one vocabulary: which tokens contain, or start with the rest of, a banned string."""
    # [ZH-START]
    # 【职责】针对一个词表（每个 token 的字节 table）回答：哪些 token 的字节包含整个禁用字符串，
    # 哪些 token 以字符串的"剩余部分"开头；并缓存编译好的 BannedWord（最多 4096 个）
    # 和 WordMatcher（最多 256 个），LRU 淘汰。
    # 【边界】不跟踪任何请求的输出；不屏蔽 logits。token 字节表由引擎在后台线程建好后传入。
    # 【协作者】LLMEngine 启动时在后台线程建一个（load_word_index），有字符串禁用词时经 _words()
    # 取用；BannedWords 从它取 matcher，同一份禁用词列表的请求共享一个自动机。
    # [ZH-END]

    def __init__(self, table: list[bytes], device: torch.device | str = "cpu"):
        self.table = table
        self.device = device
        self.ll_tokenizer = None  # llguidance's view of the vocabulary (structured output), set by the engine
        self._sorted = sorted(range(len(table)), key=table.__getitem__)  # token ids by their bytes
        self._sorted_bytes = [table[i] for i in self._sorted]
        self._offsets = [0]
        for piece in table:
            self._offsets.append(self._offsets[-1] + len(piece))
        self._blob = b"".join(table)
        self._words: OrderedDict[bytes, BannedWord] = OrderedDict()
        """Compiled words, least recently used first; bounded because clients choose the words."""
        self._matchers: OrderedDict[tuple[str, ...], WordMatcher] = OrderedDict()

    def word(self, text: str) -> BannedWord:
        # [ZH-START]
        # 1. key = 字符串的 UTF-8 字节；已缓存就 move_to_end（LRU）后返回。
        # 2. 对 k = 1..len-1：completing[k] = 字节以 key[k:] 开头的 token（输出已以前 k
        #    个字节结尾时，它们会补全整个词），用 _starting_with 在按字节排序的表上二分查找。
        # 3. containing = 字节里完整包含 key 的 token（_containing）。
        # 4. 存成 BannedWord，超过 MAX_CACHED_WORDS = 4096 个就淘汰最久未用的。
        # [ZH-END]
        key = text.encode()
        if key in self._words:
            self._words.move_to_end(key)
            return self._words[key]
        completing = {k: self._ids(self._starting_with(key[k:])) for k in range(1, len(key))}
        word = self._words[key] = BannedWord(key, self._ids(self._containing(key)), completing)
        if len(self._words) > MAX_CACHED_WORDS:
            self._words.popitem(last=False)
        return word

    def matcher(self, words: list[str]) -> WordMatcher:
        """The automaton for a request's banned strings, shared by requests with the same list."""
        # [ZH-START]
        # 1. key = tuple(words)；已缓存就 move_to_end 后返回（请求常常共用同一份禁用词列表）。
        # 2. 否则对每个词调 word() 得到 BannedWord，建 WordMatcher。
        # 3. 超过 MAX_CACHED_MATCHERS = 256 个就淘汰最久未用的。
        # [ZH-END]
        key = tuple(words)
        if key in self._matchers:
            self._matchers.move_to_end(key)
            return self._matchers[key]
        matcher = self._matchers[key] = WordMatcher([self.word(w) for w in words])
        if len(self._matchers) > MAX_CACHED_MATCHERS:
            self._matchers.popitem(last=False)
        return matcher

    def _ids(self, ids: list[int]) -> torch.Tensor:
        return torch.tensor(ids, dtype=torch.long, device=self.device)

    def _starting_with(self, prefix: bytes) -> list[int]:
        out = []
        for i in range(bisect.bisect_left(self._sorted_bytes, prefix), len(self._sorted)):
            if not self._sorted_bytes[i].startswith(prefix):
                break
            out.append(self._sorted[i])
        return out

    def _containing(self, needle: bytes) -> list[int]:
        # [ZH-START]
        # 1. _blob 是所有 token 字节首尾相接的大串，_offsets 是每个 token 的起始偏移（前缀和）。
        # 2. 用 bytes.find 在 blob 里逐个找 needle（C 速度扫描，不在 Python 里遍历词表）。
        # 3. 对每个命中位置，bisect 出它所在的 token；命中完全落在该 token
        #    内（不跨到下一个 token）才算。
        # 4. 从 pos + 1 继续找；最后去重排序返回。
        # [ZH-END]
        # One C-speed scan of all token bytes laid end to end, instead of a loop over the vocabulary.
        out = []
        pos = self._blob.find(needle)
        while pos >= 0:
            token = bisect.bisect_right(self._offsets, pos) - 1
            if pos + len(needle) <= self._offsets[token + 1]:
                out.append(token)
            pos = self._blob.find(needle, pos + 1)
        return sorted(set(out))


class BannedWord:
    # [ZH-START]
    # 【职责】一个禁用字符串的预计算结果：text（字节）、containing（包含整个词的 token）、
    # completing（k → 输出以前 k 个字节结尾时能补全该词的 token，空的 k 已去掉）。
    # 【边界】纯数据，不跟踪输出。
    # 【协作者】WordIndex.word 生成并缓存；WordMatcher 把它们挂到字典树节点上。
    # [ZH-END]
    def __init__(self, text: bytes, containing: torch.Tensor, completing: dict[int, torch.Tensor]):
        self.text = text
        self.containing = containing
        """Tokens whose bytes hold the whole string."""
        self.completing = {k: ids for k, ids in completing.items() if ids.numel()}
        """k -> tokens that finish the string when the output ends with its first k bytes."""


class WordMatcher:
    """An Aho-Corasick automaton over banned words' bytes, and the tokens to block in each state.

    A state is a trie node: the longest suffix of the output so far that starts some word. The
    output ends with word[:k] exactly when that prefix's node is the state or on its chain of
    failure links; there, the tokens starting with word[k:] would complete the word. Dictionary
    links skip the chain's nodes that block nothing, so a step visits only nodes that do.
    """
    # [ZH-START]
    # 【职责】一组禁用词字节上的 Aho-Corasick 自动机：状态 = 字典树节点（输出尾部中最长的、
    # 某个词的前缀），每个节点附带"在此状态下会补全某个词的 token"，
    # 再用字典链接跳过不屏蔽任何东西的节点。
    # 【边界】不持有请求状态（状态是 int，由 BannedWords 保存），可被多个请求共享；不直接改 logits。
    # 【协作者】WordIndex.matcher 创建并缓存；BannedWords 每步调 advance / blocked。
    # [ZH-END]

    def __init__(self, words: list[BannedWord]):
        # [ZH-START]
        # 1. always = 所有词的 containing 拼起来：任何状态下都屏蔽。
        # 2. 建字典树：对每个词逐字节向下走（没有子节点就新建），走到深度 k 的节点时，
        #    若 word.completing 有 k，就把那组 token 挂到该节点的 completing 上。
        # 3. blocks[node]：没有则 None，一组直接用，多组 torch.cat 成一个张量。
        # 4. BFS 建失败链接：子节点沿父节点的 fail 链找第一个有同一字节子节点的节点，
        #    fail[child] 指向那个子节点，找不到指向根 0；BFS 保证 fail 指向的更浅节点已处理过。
        # 5. 同时建字典链接 next_blocking[node]：fail[node] 本身屏蔽东西就指向它，
        #    否则沿用 next_blocking[fail[node]]。
        # [ZH-END]
        self.always = torch.cat([w.containing for w in words])
        """Tokens that hold a whole word: blocked in every state."""
        self.children: list[dict[int, int]] = [{}]
        completing: list[list[torch.Tensor]] = [[]]
        for word in words:
            node = 0
            for k, byte in enumerate(word.text, 1):
                if byte not in self.children[node]:
                    self.children[node][byte] = len(self.children)
                    self.children.append({})
                    completing.append([])
                node = self.children[node][byte]
                if k in word.completing:
                    completing[node].append(word.completing[k])
        self.blocks = [None if not c else c[0] if len(c) == 1 else torch.cat(c) for c in completing]
        """node -> the tokens that finish a word whose prefix is the node's bytes (None if none do)."""
        self.fail = [0] * len(self.children)
        self.next_blocking = [0] * len(self.children)
        """node -> the nearest node on its failure chain (itself excluded) that blocks something; 0 if none."""
        queue = deque(self.children[0].values())
        while queue:  # breadth first: a node's failure link is shallower, so already known
            node = queue.popleft()
            f = self.fail[node]
            self.next_blocking[node] = f if self.blocks[f] is not None else self.next_blocking[f]
            for byte, child in self.children[node].items():
                f = self.fail[node]
                while f and byte not in self.children[f]:
                    f = self.fail[f]
                self.fail[child] = self.children[f].get(byte, 0)
                queue.append(child)

    def advance(self, state: int, data: bytes) -> int:
        """The state after the output grows by `data` (amortized O(len(data)))."""
        # [ZH-START]
        # 1. 对 data 的每个字节：当前状态没有这个字节的子节点，就沿 fail 链后退（到根为止）。
        # 2. 有子节点就走过去，否则回到根 0。
        # 3. 返回新状态；均摊 O(len(data))。
        # [ZH-END]
        children, fail = self.children, self.fail
        for byte in data:
            while state and byte not in children[state]:
                state = fail[state]
            state = children[state].get(byte, 0)
        return state

    def blocked(self, state: int) -> list[torch.Tensor]:
        """Token ids that would complete a word from `state` (besides `always`)."""
        # [ZH-START]
        # 1. 起点：当前状态自己有 blocks 就从它开始，否则从 next_blocking[state] 开始。
        # 2. 沿字典链接一路收集 blocks[node]，直到根 0。
        # 3. 返回张量列表（不含 always）；只访问真正会屏蔽东西的节点。
        # [ZH-END]
        out = []
        node = state if self.blocks[state] is not None else self.next_blocking[state]
        while node:
            out.append(self.blocks[node])
            node = self.next_blocking[node]
        return out


class BannedWords:
    """Blocks the tokens that would complete one of the request's banned strings.

    Between calls it keeps the matcher state for the output it last saw: an output that extends
    it costs only the new tokens' bytes; any other (shorter, or with a different token where the
    last seen one was, e.g. another caller's) is matched again from its start.
    """
    # [ZH-START]
    # 【职责】一个请求的禁用字符串 processor：屏蔽"会让输出字节里出现某个禁用词"的 token，
    # 不管模型用什么 token 切分拼出这个词。跨步保存自动机状态，每步只处理新 token 的字节。
    # 【边界】只看输出 token（不看 prompt）；字节匹配，不做大小写或 Unicode 归一化；
    # 自动机本身属于 WordIndex 缓存。
    # 【协作者】build_logits_processors 创建；WordIndex 提供 table（token → 字节）
    # 和共享的 WordMatcher；Sampler 每步调用。
    # [ZH-END]

    def __init__(self, words: list[str], index: WordIndex):
        self.table = index.table
        self.matcher = index.matcher(words)
        self._state = 0
        self._num_seen = 0
        self._last_seen = -1

    def __call__(self, output_token_ids: Sequence[int], logits: torch.Tensor) -> torch.Tensor:
        # [ZH-START]
        # 1. 先屏蔽 matcher.always（字节里包含整个禁用词的 token）。
        # 2. n = 当前输出长度，seen = 上次处理到的长度；若输出变短，或位置 seen - 1 的 token
        #    与上次记下的不同（不是上次那个输出的延续），状态和 seen 归零，从头匹配。
        # 3. 对 [seen, n) 的每个 token，用 table[token] 的字节推进自动机状态。
        # 4. 保存 state、_num_seen = n 和最后一个 token。
        # 5. matcher.blocked(state) 给出的每组 token 都填成 -inf，返回 logits。
        # [ZH-END]
        logits.index_fill_(0, self.matcher.always, float("-inf"))
        n, seen = len(output_token_ids), self._num_seen
        if n < seen or (seen and output_token_ids[seen - 1] != self._last_seen):
            self._state = seen = 0
        state, table, advance = self._state, self.table, self.matcher.advance
        for i in range(seen, n):
            state = advance(state, table[output_token_ids[i]])
        self._state, self._num_seen = state, n
        self._last_seen = output_token_ids[n - 1] if n else -1
        for ids in self.matcher.blocked(state):
            logits.index_fill_(0, ids, float("-inf"))
        return logits


def build_logits_processors(params: SamplingParams, vocab_size: int, device: torch.device | str,
                            word_index: Callable[[], WordIndex],
                            structured: Callable[[dict], LogitsProcessor] | None = None) -> list[LogitsProcessor]:
    """The request's processors (built-in first, then its own); ValueError for ids outside the vocab.

    `word_index` is called only when string banned words are present (it may load a tokenizer).
    """
    # [ZH-START]
    # 1. 有 allowed_token_ids（SamplingParams 已存成 array('I')）：frombuffer 成一个 int64 张量，
    #    一次 max 检查都 < vocab_size（否则 ValueError，说出第一个越界的 id），加 AllowedTokenIds——
    #    26 万个 id 也没有逐个的 Python 循环。
    # 2. banned_words 里的 token id 列表：检查后加一个 BannedTokenSequences。
    # 3. banned_words 里的字符串：此时才调用 word_index()（可能要等后台线程建好
    #    字节表），加 BannedWords。
    # 4. 有 response_format：由 structured() 建一个 StructuredOutput（llguidance 语法掩码）。
    # 5. 最后追加请求自己的 logits_processors；顺序即 Sampler 调用的顺序。
    # [ZH-END]
    processors: list[LogitsProcessor] = []
    if params.allowed_token_ids is not None:
        # An array("I") (see SamplingParams): read as one tensor, checked with one max, no per-id Python.
        allowed = torch.frombuffer(params.allowed_token_ids, dtype=torch.uint32).long()
        if int(allowed.max()) >= vocab_size:
            _check_ids("allowed_token_ids", allowed[allowed >= vocab_size][:1].tolist(), vocab_size)
        processors.append(AllowedTokenIds(allowed, vocab_size, device))
    sequences = [w for w in params.banned_words if not isinstance(w, str)]
    if sequences:
        _check_ids("banned_words", [t for s in sequences for t in s], vocab_size)
        processors.append(BannedTokenSequences(sequences, device))
    words = [w for w in params.banned_words if isinstance(w, str)]
    if words:
        processors.append(BannedWords(words, word_index()))
    if params.response_format is not None:
        if structured is None:
            raise ValueError("response_format needs the model's tokenizer, which this engine has not loaded")
        processors.append(structured(params.response_format))
    processors.extend(params.logits_processors)
    return processors


def _check_ids(name: str, ids: list[int], vocab_size: int) -> None:
    bad = [t for t in ids if t >= vocab_size]
    if bad:
        raise ValueError(f"{name} has token id {show(bad[0])} outside the vocabulary [0, {vocab_size})")
