"""Grammar masks off the critical path: the masks a step samples with, computed while its forward runs.

The mask for a request's next token depends only on the output it has so far, which is fixed
once the previous step's tokens are appended, before this step's forward starts. The model
runner hands the step's sampled rows to `MaskPrefetcher.start` just before the forward; one
worker thread fills the rows' llguidance bitmasks while torch computes (both drop the GIL); the
sampler calls `wait` before it applies the masks. A batch of more than one row is filled by one
parallel llguidance call on `threads` Rust threads (`prepare_masks`); the masks are the serial
ones. A mask the worker could not compute (it raised) is computed again, and its error
reported, on the step thread: the result is the same either way, only the thread differs.
"""
# [ZH-START]
# 【模块定位】把语法掩码移出关键路径：第 t 步要用的掩码只取决于到 t-1 步为止的输出，
#   前向开始前就已确定。
#   LLMEngine.step：Sampler.prepare(本步采样的序列) → MaskPrefetcher.start（工作线程填 bitmask）
#     → 模型前向（与掩码计算重叠；llguidance 的 Rust 代码和 torch 都释放 GIL）
#     → Sampler.__call__ 先 wait 再套掩码。
# 多于一行时由 prepare_masks 一次并行调用（LLExecutor，threads 个 Rust 线程）填整批，
# 结果与逐行串行逐位相同。
# 工作线程里算失败（抛异常）的就不管了：采样时在 step 线程上重算一遍，错误照常记到该请求上——
# 结果与不重叠时完全相同。
# enabled=False 时不预取：wait 在 step 线程上（前向之后）整批计算（对照测量、精确性测试用）。
# [ZH-END]
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Sequence

from nanovllm.structured import prepare_masks


class MaskPrefetcher:
    """Fills the grammar masks of one step on a worker thread, while that step's forward runs."""
    # [ZH-START]
    # 【职责】一个工作线程（惰性创建）+ 至多一个未完成的批任务：start 提交本步所有带语法请求的掩码，
    #        wait 等它完成；threads > 1 时惰性建一个 LLExecutor，多行批次并行填。
    # 【边界】不决定掩码内容（StructuredOutput / prepare_masks）；
    #        不吞掉请求的错误（工作线程的异常丢弃，由采样时重算报告）。
    # 【协作者】Sampler 持有一个（sampler.masks，threads 取引擎的 CPU 线程数）；
    #        Sampler.prepare 调 start，Sampler.__call__ 调 wait。
    # [ZH-END]

    def __init__(self, enabled: bool = True, threads: int = 1):
        if threads < 1:
            raise ValueError(f"threads must be at least 1, got {threads}")
        self.enabled = enabled
        """False: no prefetch; `wait` computes the step's masks on the calling thread, after the forward."""
        self.threads = threads
        """Rust threads of a parallel fill; 1 fills the rows one by one (may be changed between steps)."""
        self._executor: Any | None = None
        """The `llguidance.LLExecutor` of `_executor_threads` threads, built on first use."""
        self._executor_threads = 0
        self._pool: ThreadPoolExecutor | None = None
        self._pending: Future | None = None
        self._deferred: list[tuple[Any, Sequence[int]]] = []
        self.num_prefetched = 0
        """Masks handed to the worker thread so far."""
        self.num_filled_in_parallel = 0
        """Masks filled by a parallel llguidance call so far (overlapped or not)."""

    def start(self, jobs: Sequence[tuple[Any, Sequence[int]]]) -> None:
        """Compute `grammar.prepare(output)` for each (grammar, output) on the worker thread."""
        self.wait()  # a step that failed before sampling may have left one
        if not jobs:
            return
        if not self.enabled:
            self._deferred = list(jobs)
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nanovllm-masks")
        self._pending = self._pool.submit(self._fill, list(jobs))
        self.num_prefetched += len(jobs)

    def wait(self) -> None:
        """Return once the masks of the last `start` are computed (at once if there are none)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()
        deferred, self._deferred = self._deferred, []
        if deferred:
            self._fill(deferred)

    def _fill(self, jobs: list[tuple[Any, Sequence[int]]]) -> None:
        self.num_filled_in_parallel += prepare_masks(jobs, self.executor())

    def executor(self) -> Any | None:
        """The `llguidance.LLExecutor` of `threads` threads, None for one thread. One is kept: it
        is built again only when `threads` changed since (a bench or a test trying counts)."""
        if self.threads <= 1:
            return None
        if self._executor_threads != self.threads:
            import llguidance

            self._executor, self._executor_threads = llguidance.LLExecutor(self.threads), self.threads
        return self._executor
