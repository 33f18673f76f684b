"""The report of bench/sweep.py: per system and rate vLLM's serving metrics as a markdown table,
the issue's targets (pagedserve against vLLM CPU), all figures as JSON, and two plots: throughput,
goodput and p99 latencies against the offered request rate, and the TTFT and ITL CDFs at one rate.

`results` is {system: {"command", "startup_s", "wall_s", "skipped", "error"?, "runs": {rate: the
client's saved JSON, per-request lists included}}}.
"""

from __future__ import annotations

import json

from common import OUT_DIR, REPO_ROOT, machine_lines, pyplot

COLORS = {"pagedserve": "tab:orange", "vllm": "tab:blue", "transformers": "tab:green", "llamacpp": "tab:purple"}
LABELS = {"pagedserve": "pagedserve", "vllm": "vLLM CPU", "transformers": "transformers serve (CB, fp32)",
          "llamacpp": "llama.cpp (Q4_1 GGUF)"}
HEADER = ["system", "rate /s", "done/failed", "req/s", "out tok/s", "goodput req/s", "TTFT p50/p90/p99 ms",
          "TPOT p50/p90/p99 ms", "ITL p50/p90/p99 ms", "E2E p50/p90/p99 ms"]
def is_saturated(run: dict, slo_ttft_ms: float, slo_tpot_ms: float = float("inf")) -> bool:
    """Past saturation: failures, the median request queued past the TTFT SLO, or the median
    request's TPOT past the TPOT SLO (the batch grew until every token waits on it). (Completed
    requests/s against the offered rate is no test on a short run: the client's duration includes
    the last requests' whole generation, which alone can be a third of a minute here.)"""
    return bool(run.get("failed")) or run["p50_ttft_ms"] > slo_ttft_ms or run["p50_tpot_ms"] > slo_tpot_ms


def achieved(run: dict) -> float:
    return run["completed"] / run["duration"] if run.get("duration") else 0.0


def _pcts(run: dict, metric: str) -> str:
    return " / ".join(_num(run.get(f"p{q}_{metric}_ms")) for q in (50, 90, 99))


def _num(x) -> str:
    if x is None or x != x:
        return "n/a"
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"


def rows(results: dict, slo: dict) -> list[list[str]]:
    out = []
    for name, res in results.items():
        for rate, run in res.get("runs", {}).items():
            mark = " (sat.)" if is_saturated(run, slo["ttft_ms"], slo["tpot_ms"]) else ""
            out.append([LABELS.get(name, name), rate + mark, f"{run['completed']}/{run.get('failed', 0)}",
                        _num(achieved(run)), _num(run["output_throughput"]), _num(run.get("request_goodput")),
                        _pcts(run, "ttft"), _pcts(run, "tpot"), _pcts(run, "itl"), _pcts(run, "e2el")])
        if res.get("skipped"):
            out.append([LABELS.get(name, name), ",".join(f"{r:g}" for r in res["skipped"]), "skipped: past saturation",
                        *[""] * (len(HEADER) - 3)])
    return out


def targets(results: dict, slo: dict) -> list[str]:
    """The issue's targets, pagedserve against vLLM CPU, from the runs both have."""
    ours, peer = (results.get(s, {}).get("runs", {}) for s in ("pagedserve", "vllm"))
    if not ours or not peer:
        return ["targets: need both pagedserve and vllm runs"]
    lines = []
    both = [r for r in ours if r in peer and not is_saturated(ours[r], slo["ttft_ms"], slo["tpot_ms"])
            and not is_saturated(peer[r], slo["ttft_ms"], slo["tpot_ms"])]
    for key, label in (("p99_itl_ms", "p99 ITL"), ("p99_ttft_ms", "p99 TTFT")):
        pairs = [f"{r}/s: {_num(ours[r][key])} vs {_num(peer[r][key])}" for r in both]
        met = bool(both) and all(ours[r][key] < peer[r][key] for r in both)
        lines.append(f"{label} below vLLM's at every rate neither has saturated ({', '.join(pairs) or 'none'}): "
                     f"{'MET' if met else 'MISSED'}")
    for key, label in (("output_throughput", "saturation output tok/s"), ("request_goodput", "best goodput req/s")):
        a, b = (max((run.get(key) or 0.0) for run in runs.values()) for runs in (ours, peer))
        ratio = a / b if b else float("nan")
        lines.append(f"{label}: pagedserve {_num(a)} / vLLM {_num(b)} = {ratio:.2f}x (target >= 1.3x: "
                     f"{'MET' if ratio >= 1.3 else 'MISSED'})")
    return lines


def markdown(meta: dict, results: dict) -> str:
    slo = meta["slo"]
    lines = ["# Request-rate sweep, client `vllm bench serve`", ""]
    lines += [f"- {line}" for line in machine_lines()]
    lines += [f"- dataset: {meta['dataset']}; Poisson arrivals; rates {meta['rates']}; ~{meta['duration_s']:g} s of "
              f"arrivals per rate; ignore_eos, greedy; goodput SLO: TTFT <= {slo['ttft_ms']:g} ms and TPOT <= "
              f"{slo['tpot_ms']:g} ms", f"- '(sat.)': past saturation: median TTFT above the TTFT SLO ({slo['ttft_ms']:g} ms: requests queue), "
              f"median TPOT above the TPOT SLO ({slo['tpot_ms']:g} ms: every token waits on an overfull batch), "
              "or failed requests",
              "- llama.cpp serves the GGUF as shipped (Q4_1 quantized weights): not the same arithmetic as the "
              "others (bfloat16/float32)", ""]
    for name, res in results.items():
        lines.append(f"- {LABELS.get(name, name)}: `{res.get('command', '?')}`; healthy after "
                     f"{res.get('startup_s', '?')} s; sweep took {res.get('wall_s', '?')} s"
                     + (f"; ERROR: {res['error'][-300:]}" if res.get("error") else ""))
    lines += ["", "| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(row) + " |" for row in rows(results, slo)]
    lines += ["", "## Targets (pagedserve vs vLLM CPU)", ""] + [f"- {t}" for t in targets(results, slo)]
    lines.append("")
    return "\n".join(lines)


def write_report(meta: dict, results: dict, plot: bool = False) -> None:
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    tag = meta.get("tag", "")
    (OUT_DIR / f"sweep{tag}.json").write_text(json.dumps({"meta": meta, "results": results}) + "\n")
    text = markdown(meta, results)
    (OUT_DIR / f"sweep{tag}.md").write_text(text)
    if plot:
        print(text)
        plot_rates(meta, results)
        plot_cdfs(meta, results)


def plot_rates(meta: dict, results: dict) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(2, 3, figsize=(14, 7.5))
    panels = [("req/s completed", lambda r: achieved(r), False), ("output tokens/s", lambda r: r["output_throughput"], False),
              (f"goodput req/s (TTFT<={meta['slo']['ttft_ms']:g} ms, TPOT<={meta['slo']['tpot_ms']:g} ms)",
               lambda r: r.get("request_goodput") or 0.0, False),
              ("p99 TTFT ms", lambda r: r["p99_ttft_ms"], True), ("p99 ITL ms", lambda r: r["p99_itl_ms"], True),
              ("median TPOT ms", lambda r: r["p50_tpot_ms"], True)]
    for ax, (title, get, log) in zip(axes.flat, panels):
        for name, res in results.items():
            runs = res.get("runs", {})
            if runs:
                xs = [float(r) for r in runs]
                ax.plot(xs, [get(run) for run in runs.values()], marker="o", color=COLORS.get(name),
                        linestyle="--" if name == "llamacpp" else "-", label=LABELS.get(name, name))
        if title.startswith("req/s"):
            top = max(meta["rates"])
            ax.plot([0, top], [0, top], ":", color="gray", label="offered")
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("offered request rate, req/s (Poisson)")
        if log:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    fig.suptitle(f"request-rate sweep, vllm bench serve, dataset {meta['dataset']}", fontsize=10)
    _save(fig, f"sweep{meta.get('tag', '')}.png")


def plot_cdfs(meta: dict, results: dict) -> None:
    plt = pyplot()
    fig, (ax_ttft, ax_itl) = plt.subplots(1, 2, figsize=(12, 4.2))
    for name, res in results.items():
        runs = {float(r): run for r, run in res.get("runs", {}).items()}
        if not runs:
            continue
        # the chosen rate, else the nearest below it (a slower peer's own rates)
        rate = max((r for r in runs if r <= meta["cdf_rate"]), default=min(runs))
        run, label = runs[rate], f"{LABELS.get(name, name)} @ {rate:g}/s"
        ttfts = sorted(t * 1e3 for t in run.get("ttfts", []) if t)
        itls = sorted(x * 1e3 for xs in run.get("itls", []) for x in xs)
        for ax, xs in ((ax_ttft, ttfts), (ax_itl, itls)):
            if xs:
                ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], color=COLORS.get(name), label=label,
                        linestyle="--" if name == "llamacpp" else "-")
    for ax, title in ((ax_ttft, "TTFT CDF"), (ax_itl, "ITL CDF")):
        ax.set_xscale("log")
        ax.set_xlabel("ms")
        ax.set_title(f"{title} at {meta['cdf_rate']:g} req/s", fontsize=9)
        ax.grid(alpha=0.3)
    ax_ttft.legend(fontsize=8)
    _save(fig, f"sweep{meta.get('tag', '')}-cdf.png")


def _save(fig, name: str) -> None:
    path = REPO_ROOT / "docs" / "bench" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"plot: {path}")
