"""GPU kernels per decoder layer of a decode step, predicted on CPU by counting launches.

Builds the decoder at a real width with a few layers on CPU, gives it the ops the CUDA runner
gives it (Triton paged attention; the fused Triton elementwise ops unless `fused=False`, as
NANOVLLM_TRITON_FUSED=0), and runs one decode-only step of B rows exactly as a CUDA graph replay
runs it (the graph's padded input buffers, slot -1 and context 0 on the spare rows), with the
Triton kernels in the interpreter (TRITON_INTERPRET=1). Counted as a launch: every aten op that
does device work (views, allocations and other metadata ops excluded) and every Triton kernel
launch (by kernel name); the aten ops a Triton launch runs to stage its arguments in the
interpreter are not counted. Each launch is charged to the decoder layer running it, or to
"outside" (embedding, final norm, the copy into the graph's output buffer).

This is the prediction; bench/decode_timeline.py measures the real timeline on a GPU (a GEMM may
be more than one kernel there, e.g. a split-K reduction). It is one kernel here.

At Qwen3-0.6B's shape in bf16 (engine defaults: block size 16, max_model_len 4096, so the
block table is 256 blocks wide) the fused path launches 10 kernels per layer at 1 row: the four
GEMMs (qkv, o, gate_up, down), 2 `_rms_norm_kernel` (with the residual add but in layer 0),
`_qk_norm_rope_store_kernel`, `_decode_kernel`, `_decode_reduce_kernel` and `_silu_mul_kernel`;
9 at 64 rows, where 64 x 8 kv heads fill the GPU without splitting the context, so no merge.
Outside the layers: the embedding, the final norm and the copy into the graph's output, 3; so
283 kernels a step at 28 layers and 1 row. The torch-ops path launches 61 per layer (60 in the
first), 6x as many: each of the 4 RMSNorms (input, post-attention, q, k) is a cast, pow, mean,
add, rsqrt, mul, cast and weight mul, the rotary embedding of q and of k 4 mul, a sub, an add,
a cat and 2 casts each (17 mul, 12 casts `aten::to`, 8 add, 4 each of pow, mean, rsqrt in all
with the residual adds and the MLP's `silu`, `mul`), plus the KV-cache store as a kernel of its
own; 60 at 64 rows; 1720 a step at 28 layers and 1 row.

    python -m bench.kernel_count --rows 1,64 --json counts.json   # ~70 s on 2 cores
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton compiles anything: CPU tensors

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from nanovllm.config import Config  # noqa: E402
from nanovllm.engine.cuda_graphs import DecodeGraphs  # noqa: E402
from nanovllm.layers.attention import AttentionMetadata, PagedAttention  # noqa: E402
from nanovllm.models.decoder import DecoderForCausalLM, DecoderLayer  # noqa: E402
from nanovllm.models.model_config import ModelConfig, resolve_max_model_len  # noqa: E402

QWEN3_0_6B = ModelConfig(
    architecture="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_layers=28,
    num_heads=16, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-6, rope_theta=1e6,
    max_position_embeddings=40960, tie_word_embeddings=True, attention_bias=False, qk_norm=True,
    torch_dtype=torch.bfloat16, eos_token_ids=(1,),
)
# Allocations and views: the GPU runs no kernel for them (views are caught by `OpOverload.is_view`
# and `_aliases`).
_NO_KERNEL = {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "_unsafe_view",
              "lift_fresh", "resize_", "set_"}


def _aliases(out, args) -> bool:
    """Whether every tensor `out` holds shares memory with an input: `x.to(dtype)` and `reshape`
    may return a view or a copy (a kernel), and inference mode hands them to the mode whole."""
    inputs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
    outs = out if isinstance(out, (list, tuple)) else [out]
    return all(o.untyped_storage().data_ptr() in inputs for o in outs if isinstance(o, torch.Tensor))


@dataclass
class LaunchCount:
    """Launches by kernel name ("aten::mm", "triton:_decode_kernel"), per scope ("layer 0", "outside")."""
    by_scope: dict[str, Counter] = field(default_factory=dict)

    def add(self, scope: str, name: str) -> None:
        self.by_scope.setdefault(scope, Counter())[name] += 1


class _LaunchCounter(TorchDispatchMode):
    """Charges each kernel-launching aten op, and each Triton launch, to the current scope."""

    def __init__(self):
        super().__init__()
        self.count = LaunchCount()
        self.scope = "outside"
        self._in_triton = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if not (self._in_triton or name in _NO_KERNEL or (func.is_view and _aliases(out, args))):
            self.count.add(self.scope, f"aten::{name}")
        return out

    @contextlib.contextmanager
    def triton_launch(self, kernel: str):
        self.count.add(self.scope, f"triton:{kernel}")
        self._in_triton = True
        try:
            yield
        finally:
            self._in_triton = False


@contextlib.contextmanager
def count_launches() -> Iterator[_LaunchCounter]:
    """Count the launches inside the block: `counter.count`, charged to `counter.scope` (settable)."""
    counter = _LaunchCounter()
    with _counting_triton_launches(counter), counter:
        yield counter


@contextlib.contextmanager
def _counting_triton_launches(counter: _LaunchCounter):
    """Route every Triton launch (`kernel[grid](...)`, compiled or interpreted) through `counter`."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    def counted(run):
        def launch(self, *args, grid, warmup, **kwargs):
            if warmup:
                return run(self, *args, grid=grid, warmup=warmup, **kwargs)
            with counter.triton_launch(self.fn.__name__):
                return run(self, *args, grid=grid, warmup=warmup, **kwargs)
        return launch

    originals = {cls: cls.__dict__["run"] for cls in (JITFunction, InterpretedFunction)}
    try:
        for cls, run in originals.items():
            cls.run = counted(run)
        yield
    finally:
        for cls, run in originals.items():
            cls.run = run


def set_cuda_path_ops(model: nn.Module, fused: bool) -> None:
    """The ops `ModelRunner._start` gives the model on CUDA (set_attention_kernels, set_gpu_ops)."""
    from triton.runtime.interpreter import InterpretedFunction

    from nanovllm.kernels import triton_attention, triton_fused

    if not isinstance(triton_fused._rms_norm_kernel, InterpretedFunction):
        raise RuntimeError("the Triton kernels were imported without TRITON_INTERPRET=1: they cannot take the "
                           "CPU tensors this count runs on (set it before anything imports nanovllm.kernels)")
    gpu_ops = triton_fused.TritonFusedOps() if fused else None
    for module in model.modules():
        if isinstance(module, PagedAttention):
            module.cpu_kernel, module.triton_ops = None, triton_attention
        if hasattr(module, "cpu_ops"):
            module.cpu_ops = None
        if hasattr(module, "gpu_ops"):
            module.gpu_ops = gpu_ops


@contextlib.contextmanager
def _charged_to_layers(model: nn.Module, counter: _LaunchCounter):
    """Within the block, launches inside decoder layer i go to scope "layer i", the rest to "outside"."""
    def enter(index: int):
        return lambda module, args: setattr(counter, "scope", f"layer {index}")

    layers = [m for m in model.modules() if isinstance(m, DecoderLayer)]
    hooks = [layer.register_forward_pre_hook(enter(i)) for i, layer in enumerate(layers)]
    hooks += [layer.register_forward_hook(lambda *_: setattr(counter, "scope", "outside")) for layer in layers]
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()


class _CountedReplay(DecodeGraphs):
    """DecodeGraphs whose 'replay' runs the model eagerly on the graph's buffers, counting launches."""

    def _capture(self, model: nn.Module) -> None:
        self.model = model
        self.graphs = dict.fromkeys(self.sizes)
        self.count: LaunchCount | None = None
        self.replayed_rows = 0

    def _replay(self, batch: int) -> None:
        self.replayed_rows = batch
        with count_launches() as counter, _charged_to_layers(self.model, counter):
            self.hidden[:batch] = self.model(self.input_ids[:batch], self.positions[:batch], self._metadata(batch))
        self.count = counter.count


def _cuda_path_model(cfg: ModelConfig, dtype: torch.dtype, fused: bool) -> DecoderForCausalLM:
    torch.manual_seed(0)
    model = DecoderForCausalLM(cfg)
    for param in model.parameters():
        param.data.normal_(0, 0.02)
    model.to(dtype).eval()
    set_cuda_path_ops(model, fused)
    return model


def _decode_step(rows: int, context_len: int, block_size: int) -> tuple[torch.Tensor, AttentionMetadata]:
    """Positions and metadata of `rows` sequences of `context_len` tokens, the last one new, each in
    its own blocks (block ids 0 .. rows * blocks_per_row - 1)."""
    blocks_per_row = -(-context_len // block_size)
    block_tables = torch.arange(rows * blocks_per_row, dtype=torch.int32).view(rows, blocks_per_row)
    last = context_len - 1
    meta = AttentionMetadata(
        slot_mapping=block_tables[:, last // block_size].long() * block_size + last % block_size,
        num_decode=rows, decode_block_tables=block_tables,
        decode_context_lens=torch.full((rows,), context_len, dtype=torch.int32))
    return torch.full((rows,), last), meta


def count_decode_step(rows: int, fused: bool, *, num_layers: int = 2, model_config: ModelConfig = QWEN3_0_6B,
                      context_len: int = 17, dtype: torch.dtype = torch.bfloat16, config: Config | None = None) -> dict:
    """Launches of one graphed decode step of `rows` sequences, each `context_len` tokens in cache.

    Returns {"rows", "path", "graph_rows" (the padded batch the graph runs), "kernels_per_layer"
    (of the last layer: every layer but the first, which has no residual to add, runs the same),
    "per_layer" (by name), "first_layer", "outside"}.
    """
    config = config or Config()  # the engine's block size, graph buckets (max_num_seqs), max_model_len
    cfg = replace(model_config, num_layers=num_layers)
    model = _cuda_path_model(cfg, dtype, fused)
    num_blocks = rows * -(-context_len // config.block_size)
    kv = torch.zeros(2, num_layers, num_blocks, config.block_size, cfg.num_kv_heads, cfg.head_dim, dtype=dtype)
    for i, attn in enumerate(m for m in model.modules() if isinstance(m, PagedAttention)):
        attn.k_cache, attn.v_cache = kv[0, i], kv[1, i]
    # The runner's block-table width: the decode kernel's split count follows from it.
    max_blocks = -(-resolve_max_model_len(config.max_model_len, cfg) // config.block_size)
    graphs = _CountedReplay(model, config.max_num_seqs, max_blocks, cfg.hidden_size, dtype, torch.device("cpu"))
    positions, meta = _decode_step(rows, context_len, config.block_size)
    with torch.inference_mode():
        graphs.run(torch.randint(cfg.vocab_size, (rows,)), positions, meta)
    by_scope = graphs.count.by_scope
    last_layer = by_scope[f"layer {num_layers - 1}"]
    return {"rows": rows, "path": "fused" if fused else "torch-ops", "graph_rows": graphs.replayed_rows,
            "kernels_per_layer": sum(last_layer.values()), "per_layer": dict(last_layer.most_common()),
            "first_layer": dict(by_scope["layer 0"].most_common()),
            "outside": dict(by_scope.get("outside", Counter()).most_common())}


def format_counts(result: dict) -> str:
    lines = [f"{result['path']}, {result['rows']} rows: {result['kernels_per_layer']} kernels per layer "
             f"(first layer {sum(result['first_layer'].values())}, outside the layers "
             f"{sum(result['outside'].values())})"]
    lines += [f"  {count:>3}  {name}" for name, count in result["per_layer"].items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="1,64", help="decode batch sizes, comma-separated")
    parser.add_argument("--layers", type=int, default=2, help="layers to build (>= 2: the first one differs)")
    parser.add_argument("--context", type=int, default=17, help="tokens in cache per row")
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    parser.add_argument("--json", help="also write the counts here")
    args = parser.parse_args(argv)
    if args.layers < 2:
        parser.error("--layers must be >= 2")
    results = [count_decode_step(int(rows), fused, num_layers=args.layers, context_len=args.context,
                                 dtype=getattr(torch, args.dtype))
               for rows in args.rows.split(",") for fused in (True, False)]
    print("\n\n".join(format_counts(r) for r in results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
