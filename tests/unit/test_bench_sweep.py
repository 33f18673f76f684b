"""The benchmarks' own logic (bench/sweep_report.py, bench/textdata.py, bench/netns.py): when a run
counts as past saturation, what the targets say, the seeded ShareGPT-like file, and that the
"second host" namespace is gone afterwards, also after an error. No server, no model files."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from netns import NetNamespace  # noqa: E402
from sweep_report import is_saturated, targets  # noqa: E402
from textdata import PROMPT_RANGE, REPLY_RANGE, write_sharegpt_like  # noqa: E402


SLO = {"ttft_ms": 2000, "tpot_ms": 100}


def run(rate: float, p50_ttft: float, p99_ttft: float, p99_itl: float, tok_s: float, goodput: float,
        failed: int = 0, p50_tpot: float = 20.0) -> dict:
    return {"offered_rate": rate, "failed": failed, "completed": 10, "duration": 10.0, "p50_ttft_ms": p50_ttft,
            "p99_ttft_ms": p99_ttft, "p99_itl_ms": p99_itl, "output_throughput": tok_s, "request_goodput": goodput,
            "p50_tpot_ms": p50_tpot}


def test_saturation_is_queueing_past_the_ttft_slo_an_overfull_batch_or_failures():
    assert not is_saturated(run(1, 1999, 5000, 50, 100, 1), 2000, 100)
    assert is_saturated(run(1, 2001, 5000, 50, 100, 1), 2000, 100)
    assert is_saturated(run(1, 10, 20, 50, 100, 1, failed=1), 2000, 100)
    assert not is_saturated(run(1, 10, 20, 50, 100, 1, p50_tpot=99.9), 2000, 100)
    assert is_saturated(run(1, 10, 20, 50, 100, 1, p50_tpot=100.1), 2000, 100)  # TTFT fine, every token slow
    assert not is_saturated(run(1, 10, 20, 50, 100, 1, p50_tpot=500), 2000)  # no TPOT SLO given


def test_targets_compare_only_rates_neither_system_saturated():
    ours = {"1": run(1, 100, 200, 30, 150, 1.0), "4": run(4, 150, 400, 60, 600, 3.9), "8": run(8, 9000, 20000, 90, 700, 2)}
    peer = {"1": run(1, 120, 250, 40, 150, 1.0), "4": run(4, 5000, 9000, 80, 400, 1.0), "8": run(8, 9000, 30000, 99, 450, 0)}
    lines = targets({"pagedserve": {"runs": ours}, "vllm": {"runs": peer}}, SLO)
    assert lines[0] == "p99 ITL below vLLM's at every rate neither has saturated (1/s: 30 vs 40): MET"
    assert lines[1] == "p99 TTFT below vLLM's at every rate neither has saturated (1/s: 200 vs 250): MET"
    assert lines[2] == "saturation output tok/s: pagedserve 700 / vLLM 450 = 1.56x (target >= 1.3x: MET)"
    assert lines[3] == "best goodput req/s: pagedserve 3.9 / vLLM 1 = 3.90x (target >= 1.3x: MET)"
    peer["1"]["p99_itl_ms"] = 29.0
    assert targets({"pagedserve": {"runs": ours}, "vllm": {"runs": peer}}, SLO)[0].endswith("MISSED")
    peer["1"]["p99_itl_ms"], peer["1"]["p50_tpot_ms"] = 29.0, 150.0  # vLLM past saturation at 1/s: not compared
    assert targets({"pagedserve": {"runs": ours}, "vllm": {"runs": peer}}, SLO)[0].startswith(
        "p99 ITL below vLLM's at every rate neither has saturated (none)")


class WordTokenizer:
    """One token per word: enough to check lengths and seeding without a model."""

    def __call__(self, text: str, add_special_tokens: bool = False):
        class Out:
            input_ids = [len(w) for w in text.split()]
        return Out()

    def decode(self, ids: list[int]) -> str:
        return " ".join("x" * n for n in ids)


def test_sharegpt_like_file_is_seeded_and_within_bounds(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    summary = write_sharegpt_like(a, WordTokenizer(), 300, seed=3)
    write_sharegpt_like(b, WordTokenizer(), 300, seed=3)
    assert a.read_bytes() == b.read_bytes()
    rows = json.loads(a.read_text())
    assert len(rows) == 300 and summary["num"] == 300
    prompts = [len(r["conversations"][0]["value"].split()) for r in rows]
    replies = [len(r["conversations"][1]["value"].split()) for r in rows]
    assert [r["conversations"][0]["from"] for r in rows[:2]] == ["human", "human"]
    assert PROMPT_RANGE[0] <= min(prompts) and max(prompts) <= PROMPT_RANGE[1]
    assert REPLY_RANGE[0] <= min(replies) and max(replies) <= REPLY_RANGE[1]
    assert summary["prompt_mean"] == sum(prompts) / 300
    assert len(set(prompts)) > 50  # a spread of lengths, not one


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None, reason="needs root and iproute2")
def test_namespace_reaches_the_host_address_and_is_removed_even_after_an_error():
    name = f"pstest-{os.getpid()}"
    with pytest.raises(RuntimeError, match="boom"):
        with NetNamespace(name, host_if="pst-h", ns_if="pst-n", subnet="10.232.0") as ns:
            assert name in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
            addrs = subprocess.run(ns.exec_argv(["ip", "-br", "addr"]), capture_output=True, text=True).stdout
            assert "10.232.0.2/30" in addrs
            raise RuntimeError("boom")
    assert name not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert subprocess.run(["ip", "link", "show", "pst-h"], capture_output=True).returncode != 0
