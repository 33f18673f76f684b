"""The report of bench/vllm_peer.py: per configuration a table of vLLM's figure, ours and the ratio
(ours/vLLM) at each concurrency, printed and written as markdown; all figures as JSON; and the
plot (output tokens/s and median TPOT against concurrency, both servers, a line style per dtype
configuration).

`results` is {dtype config: {server: {"startup_s", "dtype_seen", str(concurrency): {metric: value}}}}.
"""

from __future__ import annotations

import json
from pathlib import Path

from common import OUT_DIR, REPO_ROOT, machine_lines, print_table, pyplot, ratio

# metric in vllm bench serve's saved JSON -> (label, higher is better)
METRICS = {
    "output_throughput": ("output tok/s", True),
    "median_tpot_ms": ("TPOT p50 ms", False),
    "p99_tpot_ms": ("TPOT p99 ms", False),
    "median_itl_ms": ("ITL p50 ms", False),
    "p99_itl_ms": ("ITL p99 ms", False),
    "median_ttft_ms": ("TTFT p50 ms", False),
    "p99_ttft_ms": ("TTFT p99 ms", False),
}
HEADER = ["concurrency", "metric", "vLLM", "pagedserve", "ours/vLLM"]
PLOT_PATH = REPO_ROOT / "docs" / "bench" / "vllm-cpu.png"  # the README's: a run of both servers
PARTIAL_PLOT_PATH = OUT_DIR / "vllm_peer.png"  # a run of one server leaves the README's plot alone
SERVER_COLORS = {"vllm": "tab:blue", "pagedserve": "tab:orange"}
DTYPE_STYLES = ["-", "--", ":", "-."]


def config_rows(per_server: dict, levels: list[int]) -> list[list]:
    """One row per (concurrency, metric); a missing figure is nan ("n/a")."""
    rows = []
    for c in levels:
        for key, (label, higher) in METRICS.items():
            peer, ours = (_figure(per_server, s, c, key) for s in ("vllm", "pagedserve"))
            rows.append([c, f"{label} ({'higher' if higher else 'lower'} is better)", peer, ours, ratio(ours, peer)])
    return rows


def _figure(per_server: dict, server: str, concurrency: int, key: str) -> float:
    value = per_server.get(server, {}).get(str(concurrency), {}).get(key)
    return float("nan") if value is None else float(value)


def startup_line(per_server: dict) -> str:
    parts = [f"{s}: healthy after {f.get('startup_s')} s, dtype {f.get('dtype_seen') or '(not logged)'}"
             for s, f in per_server.items()]
    return "; ".join(parts)


def print_config_table(dtype: str, per_server: dict, levels: list[int]) -> None:
    print_table(f"dtype config: {dtype} ({startup_line(per_server)})", HEADER, config_rows(per_server, levels))


def write_outputs(meta: dict, results: dict, plot: bool = False, plot_path: Path | None = None) -> None:
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    (OUT_DIR / "vllm_peer.json").write_text(json.dumps({"meta": meta, "results": results}, indent=2) + "\n")
    (OUT_DIR / "vllm_peer.md").write_text(markdown(meta, results))
    if plot:
        print(f"\ntables: {OUT_DIR / 'vllm_peer.md'}\nfigures: {OUT_DIR / 'vllm_peer.json'}")
        plot_results(results, meta, plot_path)


def markdown(meta: dict, results: dict) -> str:
    lines = ["# pagedserve vs vLLM (vllm-cpu), client `vllm bench serve`", ""]
    lines += [f"- {line}" for line in machine_lines()]
    lines += [f"- vllm-cpu {meta['vllm_cpu']}; model `{meta['model']}`",
              f"- workload: {meta['workload']}; prompts per level {meta['prompts']}",
              *([f"- extra: {meta['extra']}"] if any(meta.get("extra", {}).values()) else []),
              "- ratios are ours/vLLM: above 1 is better for tok/s, below 1 is better for TPOT, ITL, TTFT", ""]
    for dtype, per_server in results.items():
        lines += [f"## dtype config: {dtype}", "", startup_line(per_server), "", *overhead_lines(meta, dtype, per_server),
                  "| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
        for row in config_rows(per_server, meta["levels"]):
            lines.append("| " + " | ".join(_cell(c) for c in row) + " |")
        lines.append("")
    return "\n".join(lines)


def overhead_lines(meta: dict, dtype: str, per_server: dict) -> list[str]:
    """What serving adds per step at concurrency 1: the server's median TPOT minus the in-process
    decode step at batch 1, both from this run."""
    step = meta.get("engine_step_ms", {}).get(dtype)
    row = per_server.get("pagedserve", {}).get("1", {})
    tpot, served_step = row.get("median_tpot_ms"), row.get("engine_decode_step_ms")
    lines = []
    if step is not None and tpot is not None:
        lines.append(f"What serving adds per step at concurrency 1: median TPOT {tpot:.2f} ms - in-process decode "
                     f"step {step:.2f} ms (measured before the servers) = **{tpot - step:.2f} ms** (target <= 1 ms)")
    after = row.get("engine_step_after_ms")
    if after is not None and tpot is not None:
        lines.append(f"... against the in-process step measured right after that client run (the server up, idle): "
                     f"{after:.2f} ms, so **{tpot - after:.2f} ms** (within minutes of it, not tens of minutes)")
    if served_step is not None and tpot is not None:
        lines.append(f"The serving engine's own decode steps while the client ran (mean, its decode_step_seconds): "
                     f"{served_step:.2f} ms, so the loop around them adds {tpot - served_step:.2f} ms per token")
    cpu = row.get("cpu_ms_per_token")
    if cpu:
        engine = {k: v for k, v in cpu.items() if k == "engine_svc"}
        bus = {k: v for k, v in cpu.items() if k not in engine}
        lines.append("CPU per output token at concurrency 1, over the client's whole run (ms; the engine's includes "
                     "its OpenMP threads' spinning): " + ", ".join(f"{k} {v:.3f}" for k, v in {**engine, **bus}.items())
                     + f"; all but the engine {sum(bus.values()):.3f} ms")
    peer = per_server.get("vllm", {}).get("1", {}).get("cpu_ms_per_token")
    if peer:
        lines.append(f"vLLM's processes over the same kind of run: {sum(peer.values()):.3f} ms of CPU per output token "
                     "in all (its compute thread spins too)")
    return lines + [""] if lines else []


def _cell(value) -> str:
    if isinstance(value, float):
        return "n/a" if value != value else f"{value:.4g}"
    return str(value)


def plot_results(results: dict, meta: dict, path: Path | None = None) -> None:
    plt = pyplot()
    levels = meta["levels"]
    fig, (ax_tps, ax_tpot) = plt.subplots(1, 2, figsize=(11, 4.2))
    for i, (dtype, per_server) in enumerate(results.items()):
        for server, color in SERVER_COLORS.items():
            if server not in per_server:
                continue
            style = DTYPE_STYLES[i % len(DTYPE_STYLES)]
            label = f"{server} ({dtype})"
            for ax, key in ((ax_tps, "output_throughput"), (ax_tpot, "median_tpot_ms")):
                ax.plot(levels, [_figure(per_server, server, c, key) for c in levels], style, color=color,
                        marker="o", label=label)
    for ax, title in ((ax_tps, "output tokens/s (higher is better)"), (ax_tpot, "median TPOT, ms (lower is better)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.set_xlabel("concurrency (vllm bench serve --max-concurrency)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    ax_tps.legend(fontsize=8)
    fig.suptitle(f"pagedserve vs vLLM CPU ({meta['vllm_cpu']}): {meta['workload']}", fontsize=10)
    both = all(set(SERVER_COLORS) <= set(per_server) for per_server in results.values())
    path = path or (PLOT_PATH if both else PARTIAL_PLOT_PATH)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")
