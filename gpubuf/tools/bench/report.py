"""Result rows, ratios, and their outputs: a printed table, a JSON file, a PNG plot.

A result is a plain dict (what the JSON file holds)::

    {"meta": {...config, environment...},
     "rows": [{op, size, buffer_rows, provider, buffer, status, reason, p50_s, p20_s, p80_s,
               repeats, calls_per_repeat, bytes_moved, gb_per_s, items_per_s, device,
               device_name, versions, git_sha}, ...],
     "ratios": [{op, size, buffer, baseline, ratio, gpubuf_p50_s, baseline_p50_s, reason,
                 bar, bar_max_ratio, meets_bar}, ...],
     "time_bars": [{op, size, buffer, device, bar, bar_max_s, gpubuf_p50_s, reason,
                    meets_bar}, ...]}

Ratios are gpubuf's median time over the baseline's median time, so below 1 means gpubuf is
faster. GB/s counts the workload's payload bytes read plus written (see
:attr:`~gpubuf.tools.bench.workloads.OpSpec.bytes_moved`), the same for every provider, so it
compares like with like.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from gpubuf.tools.bench.config import bar_for, time_bar_for
from gpubuf.tools.bench.timing import Timing
from gpubuf.tools.bench.workloads import OpSpec, Provider

OK = "ok"
UNAVAILABLE = "unavailable"
BASELINES = ("torchrl", "raw")


def _row_base(op: OpSpec, provider: Provider, buffer_rows: int, env: dict) -> dict[str, Any]:
    return {
        "op": op.kind,
        "size": op.size,
        "buffer_rows": buffer_rows,
        "provider": provider.library,
        "buffer": provider.buffer,
        "label": provider.label,
        "device": env["device"],
        "device_name": env["device_name"],
        "versions": env["versions"],
        "git_sha": env["git_sha"],
    }


def measured_row(op: OpSpec, provider: Provider, timing: Timing, buffer_rows: int, env: dict) -> dict[str, Any]:
    """The row of a provider that ran ``op``.

    Args:
        op: the op timed.
        provider: who ran it.
        timing: its per-call times.
        buffer_rows: ``N``.
        env: the environment block (see :func:`gpubuf.tools.bench.environment.collect`).
    """
    p50 = timing.p50
    row = _row_base(op, provider, buffer_rows, env)
    row.update(
        status=OK,
        reason=None,
        p50_s=p50,
        p20_s=timing.p20,
        p80_s=timing.p80,
        repeats=timing.repeats,
        calls_per_repeat=timing.number,
        bytes_moved=op.bytes_moved,
        gb_per_s=op.bytes_moved / p50 / 1e9 if p50 > 0 and op.bytes_moved else None,
        items_per_s=op.items / p50 if p50 > 0 else None,
    )
    return row


def unavailable_row(op: OpSpec, provider: Provider, reason: str, buffer_rows: int, env: dict) -> dict[str, Any]:
    """The row of a provider that could not run ``op``, saying why."""
    row = _row_base(op, provider, buffer_rows, env)
    row.update(
        status=UNAVAILABLE,
        reason=reason,
        p50_s=None,
        p20_s=None,
        p80_s=None,
        repeats=0,
        calls_per_repeat=0,
        bytes_moved=op.bytes_moved,
        gb_per_s=None,
        items_per_s=None,
    )
    return row


def compute_ratios(rows: list[dict]) -> list[dict]:
    """gpubuf / TorchRL (same buffer class) and gpubuf / raw medians, for every gpubuf row.

    A ratio whose either side is unavailable is None, with the reason.
    """
    by_key = {(r["op"], r["size"], r["provider"], r["buffer"]): r for r in rows}
    ratios = []
    for row in rows:
        if row["provider"] != "gpubuf":
            continue
        for baseline in BASELINES:
            base_buffer = row["buffer"] if baseline == "torchrl" else None
            base = by_key.get((row["op"], row["size"], baseline, base_buffer))
            if base is None:
                continue
            ratio = reason = None
            if row["status"] != OK:
                reason = f"gpubuf unavailable: {row['reason']}"
            elif base["status"] != OK:
                reason = f"{baseline} unavailable: {base['reason']}"
            else:
                ratio = row["p50_s"] / base["p50_s"]
            bar = bar_for(row["op"], row["size"], baseline, row["buffer"], row["device"])
            ratios.append(
                {
                    "op": row["op"],
                    "size": row["size"],
                    "buffer": row["buffer"],
                    "baseline": baseline,
                    "ratio": ratio,
                    "gpubuf_p50_s": row["p50_s"],
                    "baseline_p50_s": base["p50_s"],
                    "reason": reason,
                    "bar": bar.text if bar else None,
                    "bar_max_ratio": bar.max_ratio if bar else None,
                    "meets_bar": (ratio <= bar.max_ratio) if (bar and ratio is not None) else None,
                }
            )
    return ratios


def compute_time_bars(rows: list[dict]) -> list[dict]:
    """Every gpubuf row that has a time bar (:data:`~gpubuf.tools.bench.config.TIME_BARS`) on its
    device, with its median against the bar (None when the row is unavailable)."""
    entries = []
    for row in rows:
        if row["provider"] != "gpubuf":
            continue
        bar = time_bar_for(row["op"], row["size"], row["buffer"], row["device"])
        if bar is None:
            continue
        p50 = row["p50_s"] if row["status"] == OK else None
        entries.append(
            {
                "op": row["op"],
                "size": row["size"],
                "buffer": row["buffer"],
                "device": row["device"],
                "bar": bar.text,
                "bar_max_s": bar.max_s,
                "gpubuf_p50_s": p50,
                "reason": None if p50 is not None else f"gpubuf unavailable: {row['reason']}",
                "meets_bar": (p50 <= bar.max_s) if p50 is not None else None,
            }
        )
    return entries


# ---------------------------------------------------------------------------- text
def format_time(seconds: float | None) -> str:
    """``12.3 us``, ``4.56 ms``, ``1.23 s``; ``-`` for None."""
    if seconds is None or (isinstance(seconds, float) and math.isnan(seconds)):
        return "-"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.1f} us"
    if seconds < 1:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds:.3f} s"


def _format_rate(value: float | None) -> str:
    if value is None:
        return "-"
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if value >= scale:
            return f"{value / scale:.2f}{unit}"
    return f"{value:.0f}"


def _format_ratio(entry: dict | None) -> str:
    if entry is None:
        return ""
    if entry["ratio"] is None:
        return "n/a"
    return f"{entry['ratio']:.2f}"


def format_table(result: dict) -> str:
    """The result as a fixed-width text table, then one line per bar."""
    meta = result["meta"]
    ratios = {(r["op"], r["size"], r["buffer"], r["baseline"]): r for r in result["ratios"]}
    header = ["op", "provider", "p50", "p20 .. p80", "GB/s", "items/s", "/torchrl", "/raw"]
    lines_data = []
    for row in result["rows"]:
        op = f"{row['op']} {row['size']:,}"
        if row["status"] != OK:
            lines_data.append([op, row["label"], "unavailable: " + (row["reason"] or ""), "", "", "", "", ""])
            continue
        key = (row["op"], row["size"], row["buffer"])
        is_gpubuf = row["provider"] == "gpubuf"
        lines_data.append(
            [
                op,
                row["label"],
                format_time(row["p50_s"]),
                f"{format_time(row['p20_s'])} .. {format_time(row['p80_s'])}",
                f"{row['gb_per_s']:.2f}" if row["gb_per_s"] is not None else "-",
                _format_rate(row["items_per_s"]),
                _format_ratio(ratios.get((*key, "torchrl"))) if is_gpubuf else "",
                _format_ratio(ratios.get((*key, "raw"))) if is_gpubuf else "",
            ]
        )
    # Unavailable rows carry a long reason in one cell: keep it out of the column widths.
    widths = [len(h) for h in header]
    for line in lines_data:
        if line[3] == "" and line[2].startswith("unavailable"):
            cells = line[:2]
        else:
            cells = line
        widths[: len(cells)] = [max(w, len(c)) for w, c in zip(widths, cells)]
    out = [
        f"gpubuf bench ({meta['config']['name']}): N={meta['config']['rows']:,} rows on {meta['device']} "
        f"({meta['device_name']}), torch threads={meta['torch_threads']}",
        "times are medians per call (p20 .. p80); ratios are gpubuf / baseline medians (< 1: gpubuf faster)",
    ]
    out.extend(meta.get("notes", []))
    out.append("  ".join(h.ljust(w) for h, w in zip(header, widths)))
    out.append("  ".join("-" * w for w in widths))
    previous_op = None
    for line in lines_data:
        if previous_op is not None and line[0] != previous_op:
            out.append("")
        previous_op = line[0]
        if line[3] == "" and line[2].startswith("unavailable"):
            out.append("  ".join([line[0].ljust(widths[0]), line[1].ljust(widths[1]), line[2]]))
        else:
            out.append("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip())
    bars = [r for r in result["ratios"] if r["bar"]]
    time_bars = result.get("time_bars", [])
    if bars or time_bars:
        out.append("")
        out.append("bars (measured, not asserted):")
        for r in bars:
            ratio = r["ratio"]
            out.append(
                _bar_line(r, None if ratio is None else f"gpubuf/{r['baseline']} = {ratio:.3f} (need <= {r['bar_max_ratio']:.3f})")
            )
        for r in time_bars:
            p50 = r["gpubuf_p50_s"]
            out.append(_bar_line(r, None if p50 is None else f"median {format_time(p50)}"))
    return "\n".join(out)


def _bar_line(entry: dict, measured: str | None) -> str:
    """One line of the bars: the op, the bar, what was measured (None: unavailable) and the verdict."""
    name = f"  {entry['op']} {entry['size']:,} gpubuf {entry['buffer']}: {entry['bar']}"
    if measured is None:
        return f"{name}: n/a ({entry['reason']})"
    return f"{name}: {measured} {'met' if entry['meets_bar'] else 'MISSED'}"


# ---------------------------------------------------------------------------- files
def write_json(result: dict, path: str | Path) -> Path:
    """Writes ``result`` as indented JSON; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2, sort_keys=False) + "\n", encoding="utf-8")
    return path


def write_plot(result: dict, path: str | Path) -> Path:
    """Writes a PNG: one panel per op, a bar per provider (median, p20-p80 whiskers).

    Uses matplotlib's Agg canvas directly, so no display and no global pyplot state is needed.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    ops: list[tuple[str, int]] = []
    for row in result["rows"]:
        if (row["op"], row["size"]) not in ops:
            ops.append((row["op"], row["size"]))
    ratios = {(r["op"], r["size"], r["buffer"], r["baseline"]): r for r in result["ratios"]}
    ncols = min(2, max(1, len(ops)))
    nrows = max(1, math.ceil(len(ops) / ncols))
    fig = Figure(figsize=(6.5 * ncols, 4.0 * nrows), layout="constrained")
    FigureCanvasAgg(fig)
    colors = {"gpubuf": "#1f77b4", "torchrl": "#ff7f0e", "raw": "#7f7f7f"}
    for i, (kind, size) in enumerate(ops):
        ax = fig.add_subplot(nrows, ncols, i + 1)
        rows = [r for r in result["rows"] if (r["op"], r["size"]) == (kind, size)]
        ok = [r for r in rows if r["status"] == OK]
        scale, unit = _time_unit(max((r["p80_s"] for r in ok), default=1e-3))
        for x, row in enumerate(rows):
            if row["status"] != OK:
                ax.text(x, 0, "n/a", ha="center", va="bottom", fontsize=8, color="gray")
                continue
            p50, p20, p80 = (row[k] * scale for k in ("p50_s", "p20_s", "p80_s"))
            ax.bar(x, p50, color=colors.get(row["provider"], "#2ca02c"), alpha=0.9 if row["buffer"] != "ReplayBuffer" else 0.55)
            ax.errorbar(x, p50, yerr=[[p50 - p20], [p80 - p50]], color="black", capsize=3, linewidth=1)
            notes = []
            if row["provider"] == "gpubuf":
                for baseline in ("torchrl", "raw"):
                    entry = ratios.get((kind, size, row["buffer"], baseline))
                    if entry and entry["ratio"] is not None:
                        notes.append(f"{entry['ratio']:.2f}x {baseline}")
            if notes:
                ax.text(x, p80, "\n".join(notes), ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(rows)), [r["label"] for r in rows], rotation=20, fontsize=8)
        ax.set_ylabel(f"time per call ({unit})")
        ax.set_title(f"{kind} {'chunk' if kind == 'extend' else 'B'}={size:,}", fontsize=10)
        ax.margins(y=0.25)
    meta = result["meta"]
    fig.suptitle(
        f"gpubuf bench ({meta['config']['name']}), N={meta['config']['rows']:,}, {meta['device_name']}, "
        f"gpubuf {str(meta.get('git_sha') or '')[:10]}",
        fontsize=10,
    )
    fig.savefig(path, dpi=110)
    return path


def _time_unit(seconds: float) -> tuple[float, str]:
    if seconds < 1e-3:
        return 1e6, "us"
    if seconds < 1:
        return 1e3, "ms"
    return 1.0, "s"


__all__ = [
    "OK",
    "UNAVAILABLE",
    "compute_ratios",
    "compute_time_bars",
    "format_table",
    "format_time",
    "measured_row",
    "unavailable_row",
    "write_json",
    "write_plot",
]
