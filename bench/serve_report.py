"""Tables and a plot of a `bench/serve.py --sweep` result (the dict it writes as JSON).

    python -m bench.serve_report docs/results/serve_sweep.json [--png docs/img/serve_sweep.png]

redraws both from a saved JSON. The plot needs matplotlib (`pip install -e '.[bench]'`).
"""
from __future__ import annotations

import argparse
import json
import sys


def _ms(row: dict, key: str) -> str:
    return f"{row[key + '_p50_ms']:,.1f} / {row[key + '_p99_ms']:,.1f}"


def _cpu(row: dict) -> str:
    cpu = row["cpu_s"]
    return (f"{cpu['engine_proc']:.1f} / {cpu['tokenizer_proc'] + cpu['detok_proc']:.1f} / "
            f"{cpu.get('clients', float('nan')):.1f}")


def _kv(row: dict) -> str:
    return f"{row['kv_blocks_peak']:,} / {row['kv_blocks']:,} ({row['kv_usage_peak']:.0%})"


def markdown_tables(result: dict) -> str:
    out = []
    header = ("| concurrency | requests | out tok/s (runs) | TTFT p50 / p99 ms | ITL p50 / p99 ms | steps/s "
              "| KV blocks peak / total | preemptions | CPU s: engine / tok+detok / clients |\n" + "| --- " * 9 + "|")
    for key, title in (("levels", "Model"), ("null", "Null model")):
        rows = result.get(key)
        if not rows:
            continue
        out += [f"\n{title}:\n", header]
        for r in rows:
            runs = ", ".join(f"{v:,.1f}" for v in r["all_tok_s"])
            out.append(f"| {r['concurrency']} | {r['num_requests']} | {r['output_tok_s']:,.1f} ({runs}) "
                       f"| {_ms(r, 'ttft')} | {_ms(r, 'itl')} | {r['steps_per_s']:,.1f} | {_kv(r)} "
                       f"| {r['preemptions']} | {_cpu(r)} |")
        top = rows[-1]
        if "offline" in top:
            out.append(f"\n{title} at concurrency {top['concurrency']}: service {top['output_tok_s']:,.1f} out tok/s, "
                       f"`LLM.generate` in-process {top['offline']['output_tok_s']:,.1f} "
                       f"({top['offline'].get('dtype', 'dtype not recorded')}; "
                       f"runs: {', '.join(f'{v:,.1f}' for v in top['all_offline_tok_s'])}), "
                       f"ratio **{top['service_over_offline']:.3f}**.")
    if result.get("pressure"):
        out += ["\nKV-cache pressure:\n",
                "| KV blocks | engine args | concurrency | out tok/s (runs) | TTFT p50 / p99 ms | ITL p50 / p99 ms "
                "| KV blocks peak / total, mean use | preemptions |\n" + "| --- " * 8 + "|"]
        for r in result["pressure"]:
            knobs = ", ".join(f"{k}={v}" for k, v in r["knobs"].items()) or "-"
            runs = ", ".join(f"{v:,.1f}" for v in r["all_tok_s"])
            out.append(f"| {r['num_kvcache_blocks']} | {knobs} | {r['concurrency']} | {r['output_tok_s']:,.1f} ({runs}) "
                       f"| {_ms(r, 'ttft')} | {_ms(r, 'itl')} | {_kv(r)}, {r['kv_usage_mean']:.0%} "
                       f"| {r['preemptions']} |")
    return "\n".join(out)


def plot(result: dict, path: str) -> None:
    """Throughput and latency against concurrency: the model, its pressure runs, the null model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [p for p in ("levels", "null") if result.get(p)]
    fig, axes = plt.subplots(1, len(panels) + ("levels" in panels), figsize=(5.2 * (len(panels) + 1), 4.2),
                             squeeze=False)
    axes = list(axes[0])
    if "levels" in panels:
        rows = result["levels"]
        x = [r["concurrency"] for r in rows]
        ax = axes.pop(0)
        ax.plot(x, [r["output_tok_s"] for r in rows], "o-", label="service")
        top = rows[-1]
        if "offline" in top:
            ax.plot([top["concurrency"]], [top["offline"]["output_tok_s"]], "s", label="LLM.generate in-process")
        for r in result.get("pressure", []):
            knobs = "".join(f", {k}={v}" for k, v in r["knobs"].items())
            ax.plot([r["concurrency"]], [r["output_tok_s"]], "v",
                    label=f"{r['num_kvcache_blocks']} KV blocks{knobs}: {r['preemptions']} preemptions")
        ax.set_ylim(bottom=0)
        _axis(ax, "model: output tokens/s", "tokens/s", x)
        ax = axes.pop(0)
        for key, marker, color in (("ttft", "o", "C0"), ("itl", "s", "C2")):
            for q, line in (("p50", "-"), ("p99", "--")):
                ax.plot(x, [r[f"{key}_{q}_ms"] for r in rows], marker + line, color=color, label=f"{key.upper()} {q}")
        ax.set_yscale("log")
        _axis(ax, "model: latency", "ms", x)
    if "null" in panels:
        rows = result["null"]
        x = [r["concurrency"] for r in rows]
        ax = axes.pop(0)
        ax.plot(x, [r["output_tok_s"] for r in rows], "o-", label="tokens/s streamed")
        ax.plot(x, [r["steps_per_s"] for r in rows], "s--", label="engine steps/s")
        top = rows[-1]
        if "offline" in top:
            ax.plot([top["concurrency"]], [top["offline"]["output_tok_s"]], "^", label="tokens/s, engine in-process")
        ax.set_yscale("log")
        _axis(ax, "null model (no model work)", "per second", x)
    fig.suptitle(f"nanovllm serve, {result.get('cpu_model') or 'CPU'}, {result.get('cores')} cores, "
                 f"{result.get('date', '')}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _axis(ax, title: str, ylabel: str, levels: list[int]) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xticks(levels, [str(level) for level in levels], minor=False)
    ax.set_xticks([], minor=True)
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("json")
    parser.add_argument("--png", default=None)
    args = parser.parse_args(argv)
    with open(args.json) as f:
        result = json.load(f)
    print(markdown_tables(result))
    if args.png:
        plot(result, args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
