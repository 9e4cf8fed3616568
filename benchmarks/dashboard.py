"""A run's dashboard: one self-contained HTML file (charts embedded as PNG data) and the headline chart as a PNG.

    .venv/bin/python -m benchmarks.dashboard benchmarks/results/compare-<time>.json   # rebuild from a run's JSON
"""

from __future__ import annotations

import base64
import html
import io
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, never a window
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)
from matplotlib.figure import Figure  # noqa: E402

LATENCIES = [("ttft", "time to first token"), ("itl", "inter-token latency"), ("tpot", "time per output token"),
             ("e2e", "end-to-end latency")]


def _ok_rows(record: dict, workload: str) -> list[dict]:
    return [row for row in record["rows"] if row["workload"] == workload and row["status"] == "ok"]


def _height(record: dict) -> float:
    """Figure height for one bar per engine."""
    return 0.8 + 0.45 * len({row["engine"] for row in record["rows"]})


def _panel_width(record: dict) -> float:
    """Width of one panel of bars: the bars' room plus the engine names beside them (variant names run long)."""
    return 3.5 + 0.075 * max(len(row["engine"]) for row in record["rows"])


def headline_figure(record: dict) -> Figure:
    """Output tokens/s of every engine, one panel per workload."""
    fig = _bars_per_workload(record, "output_tokens_per_s", "output tokens/s (higher is better)", "tab:blue")
    fig.suptitle(f"{record['model']}, revision {record['revision']}, {record['machine']['cpu']}", fontsize=9)
    return fig


def latency_figure(record: dict, workload: str) -> Figure:
    """p50 bars with the p99 as a tick, for TTFT, inter-token and end-to-end latency."""
    rows = _ok_rows(record, workload)
    # (A run recorded before TPOT was measured has none to draw.)
    latencies = [(key, title) for key, title in LATENCIES if all(f"{key}_p50_ms" in row["metrics"] for row in rows)]
    fig, axes = plt.subplots(1, len(latencies), figsize=(len(latencies) * _panel_width(record), _height(record)),
                             layout="constrained")
    for ax, (key, title) in zip(axes, latencies):
        names = [row["engine"] for row in rows]
        p50 = [row["metrics"][f"{key}_p50_ms"] for row in rows]
        p99 = [row["metrics"][f"{key}_p99_ms"] for row in rows]
        ax.barh(names, p50, color="tab:orange", label="p50")
        ax.scatter(p99, names, marker="|", s=300, color="black", label="p99", zorder=3)
        ax.invert_yaxis()
        ax.set_title(f"{title}, ms (lower is better)", fontsize=10)
    fig.legend(*axes[0].get_legend_handles_labels(), loc="outside upper right", fontsize=8)
    fig.suptitle(record["workloads"][workload]["description"], fontsize=10)
    return fig


def memory_figure(record: dict) -> Figure:
    return _bars_per_workload(record, "peak_memory_mib", "peak memory, MiB", "tab:green")


def _bars_per_workload(record: dict, metric: str, title: str, color: str) -> Figure:
    """One labelled bar per engine of `metric`, one panel per workload."""
    workloads = list(record["workloads"])
    fig, axes = plt.subplots(1, len(workloads), figsize=(len(workloads) * _panel_width(record), _height(record)),
                             squeeze=False, layout="constrained")
    for ax, workload in zip(axes[0], workloads):
        rows = _ok_rows(record, workload)
        bars = ax.barh([row["engine"] for row in rows], [row["metrics"][metric] for row in rows], color=color)
        ax.bar_label(bars, fmt="%.0f", padding=3)
        ax.invert_yaxis()  # in the order the engines were given
        ax.set_title(f"{workload}: {title}", fontsize=10)
        ax.margins(x=0.15)
    return fig


def _png(fig: Figure) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    plt.close(fig)
    return buffer.getvalue()


def _img(png: bytes) -> str:
    return f'<img src="data:image/png;base64,{base64.b64encode(png).decode()}">'


def _table(record: dict, workload: str) -> str:
    columns = ["requests_per_s", "output_tokens_per_s", "total_tokens_per_s", "ttft_p50_ms", "ttft_p99_ms",
               "itl_p50_ms", "itl_p99_ms", "tpot_p50_ms", "tpot_p99_ms", "e2e_p50_ms", "e2e_p99_ms", "peak_memory_mib"]
    head = "".join(f"<th>{c}</th>" for c in ["engine", *columns, "how tokens are timed"])
    body = []
    for row in (r for r in record["rows"] if r["workload"] == workload):
        name = html.escape(row["engine"])
        if row["status"] != "ok":
            body.append(f"<tr><td>{name}</td><td colspan={len(columns) + 1}>{row['status']}: "
                        f"{html.escape(row['error'])}</td></tr>")
            continue
        cells = "".join(f"<td>{row['metrics'][c]:.2f}</td>" if c in row["metrics"] else "<td>–</td>" for c in columns)
        body.append(f"<tr><td>{name}</td>{cells}<td class=note>{html.escape(row['timing'])}</td></tr>")
    return f"<table><tr>{head}</tr>{''.join(body)}</table>"


def write_dashboard(record: dict, html_path: Path, png_path: Path) -> None:
    headline = _png(headline_figure(record))
    png_path.write_bytes(headline)
    machine = record["machine"]
    sections = [
        f"<h1>liteinfer benchmark, {html.escape(record['date'])}</h1>",
        f"<p>revision {record['revision']}{' with uncommitted changes' if record['dirty'] else ''}; "
        f"{html.escape(machine['cpu'])}, {machine['cores']} cores, {machine['memory_gib']} GiB"
        f"{', ' + html.escape(machine['gpu']) if machine['gpu'] else ''}; {record['threads']} threads per engine; "
        f"model {html.escape(record['model'])}</p>",
        f"<pre>{html.escape(record['command'])}</pre>",
        _img(headline),
        _img(_png(memory_figure(record))),
    ]
    for workload, info in record["workloads"].items():
        sections += [f"<h2>{html.escape(info['description'])}</h2>", f"<p>workload hash {info['hash']}</p>",
                     _table(record, workload), _img(_png(latency_figure(record, workload)))]
    style = ("body{font-family:sans-serif;margin:2em}table{border-collapse:collapse;font-size:13px}"
             "td,th{border:1px solid #ccc;padding:3px 6px;text-align:right}td.note{text-align:left;font-size:11px}"
             "img{max-width:100%;display:block;margin:1em 0}")
    html_path.write_text(f"<!doctype html><html><head><meta charset=utf-8><title>liteinfer benchmark</title>"
                         f"<style>{style}</style></head><body>{''.join(sections)}</body></html>")


if __name__ == "__main__":
    json_path = Path(sys.argv[1])
    write_dashboard(json.loads(json_path.read_text()), json_path.with_suffix(".html"), json_path.with_suffix(".png"))
