"""Grammar masks off the critical path: the masks a step samples with, computed while its forward runs.

The mask for a request's next token depends only on the output it has so far, which is fixed
once the previous step's tokens are appended, before this step's forward starts. The model
runner hands the step's sampled rows to `MaskPrefetcher.start` just before the forward; one
worker thread fills each row's llguidance bitmask (Rust code that drops the GIL) while torch
computes (which drops it too); the sampler calls `wait` before it applies the masks. A mask the
worker could not compute (it raised) is computed again, and its error reported, on the step
thread: the result is the same either way, only the thread differs.
"""
# [ZH-START]
# 【模块定位】把语法掩码移出关键路径：第 t 步要用的掩码只取决于到 t-1 步为止的输出，
#   前向开始前就已确定。
#   ModelRunner.run：Sampler.prepare(本步采样的序列) → MaskPrefetcher.start（工作线程填 bitmask）
#     → 模型前向（与掩码计算重叠；llguidance 的 Rust 代码和 torch 都释放 GIL）
#     → Sampler.__call__ 先 wait 再套掩码。
# 工作线程里算失败（抛异常）的就不管了：采样时在 step 线程上重算一遍，错误照常记到该请求上——
# 结果与不重叠时完全相同。
# enabled=False 时不预取，掩码都在采样时算（对照测量、精确性测试用）。
# [ZH-END]
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Sequence


class MaskPrefetcher:
    """Fills the grammar masks of one step on a worker thread, while that step's forward runs."""
    # [ZH-START]
    # 【职责】一个工作线程（惰性创建）+ 至多一个未完成的批任务：start 提交本步所有带语法请求的
    # prepare，wait 等它完成。
    # 【边界】不决定掩码内容（StructuredOutput.prepare）；不吞掉请求的错误（工作线程的异常丢弃，
    # 由采样时重算报告）。
    # 【协作者】Sampler 持有一个（sampler.masks），Sampler.prepare 调 start，
    # Sampler.__call__ 调 wait。
    # [ZH-END]

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        """False: no prefetch; the sampler computes every mask when it applies it."""
        self._pool: ThreadPoolExecutor | None = None
        self._pending: Future | None = None
        self.num_prefetched = 0
        """Masks handed to the worker thread so far."""

    def start(self, jobs: Sequence[tuple[Any, Sequence[int]]]) -> None:
        """Compute `grammar.prepare(output)` for each (grammar, output) on the worker thread."""
        self.wait()  # a step that failed before sampling may have left one
        if not self.enabled or not jobs:
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nanovllm-masks")
        self._pending = self._pool.submit(_prepare_all, list(jobs))
        self.num_prefetched += len(jobs)

    def wait(self) -> None:
        """Return once the last batch started is done (at once if there is none)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()


def _prepare_all(jobs: list[tuple[Any, Sequence[int]]]) -> None:
    for grammar, output in jobs:
        try:
            grammar.prepare(output)
        except Exception:  # computed again on the step thread, which reports it as the request's error
            pass
