"""The report of `metroserve bench serve`: its markdown table, PNG plots and the comparison of reports.

Plots are drawn from the JSON report (so `--compare` can redraw them).

Sweep values go on a categorical x axis: they are often geometric (1, 4, 16) and a request rate
may be `inf` (all at once), neither of which a linear axis shows well.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only; no display on servers
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

LATENCIES = (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("e2e_s", "E2E latency"))


def _title(report: dict[str, Any], what: str) -> str:
    return f"{report['label']}: {what}" if report.get("label") else what


def _save(fig: plt.Figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_latency_cdfs(report: dict[str, Any], path: Path) -> Path:
    """Empirical CDFs of TTFT, TPOT and end-to-end latency (ms), one line per run."""
    fig, axes = plt.subplots(1, len(LATENCIES), figsize=(5 * len(LATENCIES), 4))
    for ax, (key, name) in zip(axes, LATENCIES):
        for run in report["runs"]:
            values = np.sort([r[key] * 1000 for r in run["requests"] if r["success"] and r[key] is not None])
            if len(values):
                ax.step(values, np.arange(1, len(values) + 1) / len(values), where="post", label=run["summary"]["name"])
        ax.set(title=name, xlabel="ms", ylabel="fraction of requests", ylim=(0, 1.02))
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize="small")
    fig.suptitle(_title(report, "latency distributions"))
    return _save(fig, path)


def plot_sweep(report: dict[str, Any], path: Path) -> Path:
    """Output throughput and p50/p99 TTFT and E2E latency against the swept value."""
    summaries = [run["summary"] for run in report["runs"]]
    key = report["sweep_key"]
    x = np.arange(len(summaries))
    ticks = [str(s[key]) if s[key] is not None else "inf" for s in summaries]
    xlabel = {"max_concurrency": "max concurrency", "request_rate": "request rate (req/s)"}[key]
    fig, (tput, lat) = plt.subplots(1, 2, figsize=(11, 4))
    tput.plot(x, [s["output_throughput"] for s in summaries], "o-")
    tput.set(title="output throughput", ylabel="output tokens/s")
    for metric, name, color in (("ttft_ms", "TTFT", "C0"), ("e2el_ms", "E2E", "C1")):
        for pct, style in (("p50", "o-"), ("p99", "s--")):
            lat.plot(x, [s[metric][pct] for s in summaries], style, color=color, label=f"{name} {pct}")
    lat.set(title="latency", ylabel="ms")
    lat.legend(fontsize="small")
    for ax in (tput, lat):
        ax.set_xticks(x, ticks)
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
    fig.suptitle(_title(report, f"sweep over {xlabel}"))
    return _save(fig, path)


def plot_comparison(reports: list[dict[str, Any]], path: Path) -> Path:
    """TTFT (p50, p99 as whisker) and output throughput of each report's runs, labels side by side."""
    run_names = list(dict.fromkeys(run["summary"]["name"] for rep in reports for run in rep["runs"]))
    x = np.arange(len(run_names))
    width = 0.8 / len(reports)
    fig, (ttft, tput) = plt.subplots(1, 2, figsize=(11, 4))
    for i, rep in enumerate(reports):
        by_name = {run["summary"]["name"]: run["summary"] for run in rep["runs"]}
        rows = [by_name.get(name) for name in run_names]
        offset = x + (i - (len(reports) - 1) / 2) * width
        p50 = [s["ttft_ms"]["p50"] if s and s["ttft_ms"]["p50"] is not None else np.nan for s in rows]
        p99 = [s["ttft_ms"]["p99"] if s and s["ttft_ms"]["p99"] is not None else np.nan for s in rows]
        ttft.bar(offset, p50, width, yerr=[np.zeros(len(p50)), np.clip(np.subtract(p99, p50), 0, None)], capsize=3,
                 label=rep.get("label") or f"report {i + 1}")
        tput.bar(offset, [s["output_throughput"] if s else np.nan for s in rows], width,
                 label=rep.get("label") or f"report {i + 1}")
    ttft.set(title="TTFT p50 (whisker: p99)", ylabel="ms")
    tput.set(title="output throughput", ylabel="output tokens/s")
    for ax in (ttft, tput):
        ax.set_xticks(x, run_names)
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize="small")
    fig.suptitle("comparison: " + " vs ".join(rep.get("label") or "?" for rep in reports))
    return _save(fig, path)


def _fmt(value: float | None, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def _triple(stats: dict[str, float | None]) -> str:
    return " / ".join(_fmt(stats[k]) for k in ("mean", "p50", "p99"))


def format_table(rows: list[tuple[str | None, dict[str, Any]]]) -> str:
    """A markdown table, one row per (label, run summary); goodput and spec columns only when present."""
    goodput = any(s["goodput"] is not None for _, s in rows)
    spec = any(s["server"].get("spec_acceptance_rate") is not None for _, s in rows)
    head = ["label", "run", "ok", "failed", "s", "req/s", "out tok/s", "total tok/s", "TTFT ms mean/p50/p99",
            "TPOT ms mean/p50/p99", "ITL ms mean/p50/p99", "E2E ms mean/p50/p99"]
    if goodput:
        head.append("goodput req/s")
    head.append("prefix hit")
    if spec:
        head.append("spec accept / mean len")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label, s in rows:
        server = s["server"]
        cells = [label or "-", s["name"], str(s["completed"]), str(s["failed"]), _fmt(s["duration_s"]),
                 _fmt(s["request_throughput"], ".2f"), _fmt(s["output_throughput"]),
                 _fmt(s["total_token_throughput"]), _triple(s["ttft_ms"]), _triple(s["tpot_ms"]),
                 _triple(s["itl_ms"]), _triple(s["e2el_ms"])]
        if goodput:
            cells.append(_fmt(s["goodput"], ".2f"))
        cells.append(_fmt(server.get("prefix_cache_hit_rate"), ".1%"))
        if spec:
            cells.append(f"{_fmt(server.get('spec_acceptance_rate'), '.1%')} / "
                         f"{_fmt(server.get('spec_mean_acceptance_length'), '.2f')}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _slug(label: str | None) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", label).strip("-") + "-" if label else ""


def write_plots(report: dict[str, Any], plot_dir: Path) -> list[Path]:
    """Latency CDFs always; throughput and latency against the swept value for a sweep."""
    prefix = _slug(report["label"])
    paths = [plot_latency_cdfs(report, plot_dir / f"{prefix}latency_cdf.png")]
    if report["sweep_key"] is not None:
        paths.append(plot_sweep(report, plot_dir / f"{prefix}sweep.png"))
    return paths


def compare_reports(paths: list[Path | str], plot_dir: Path | str | None = None) -> str:
    """Print one table over several --result-json reports (e.g. prefix caching on vs off); with
    plot_dir, also write it there as compare.md with compare.png (TTFT and throughput side by side).
    Reports with the same label are joined, so one file per sweep value (each from a fresh server,
    when a warm cache would skew later runs) plots as one configuration."""
    by_label: dict[str, dict[str, Any]] = {}
    for p in paths:
        report = json.loads(Path(p).read_text())
        label = report.get("label") or Path(p).stem
        if label in by_label:
            by_label[label]["runs"] += report["runs"]
        else:
            by_label[label] = {**report, "label": label}
    table = format_table([(label, run["summary"]) for label, rep in by_label.items() for run in rep["runs"]])
    print(table)
    if plot_dir is not None:
        plot_dir = Path(plot_dir)
        plot_comparison(list(by_label.values()), plot_dir / "compare.png")
        (plot_dir / "compare.md").write_text(table + "\n")
    return table
