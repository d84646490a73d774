"""Turn benchmark results into a Markdown report, a JSON file and a bus-bandwidth plot."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from typing import Any

from . import _util

SYSTEM_LABELS = {"ringcomm": "ringcomm", "gloo": "gloo", "horovod": "Horovod",
                 "ringcomm-encrypted": "ringcomm encrypted"}


def sig(value: float | None, digits: int = 3) -> str:
    """``value`` with ``digits`` significant digits, no exponent for everyday magnitudes; ``n/a`` if missing."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "n/a"
    if value == 0:
        return "0"
    decimals = max(0, digits - 1 - math.floor(math.log10(abs(value))))
    return f"{value:.{decimals}f}"


def short_machine_line(meta: dict[str, Any]) -> str:
    """A plot-title-sized version of :func:`machine_line`."""
    return (f"{str(meta.get('date', ''))[:10]}, {meta.get('usable_cores')} cores, Python {meta.get('python')}, "
            f"torch {meta.get('torch')}, pyzmq {meta.get('pyzmq')}, ringcomm {meta.get('ringcomm_git')}")


def machine_line(meta: dict[str, Any]) -> str:
    """One sentence saying where and with what the numbers were taken."""
    cpu = f" ({meta['cpu_model']})" if meta.get("cpu_model") else ""
    knobs = meta.get("ringcomm_knobs") or {}
    knob_text = f"; ringcomm knobs: {', '.join(f'{k}={v}' for k, v in knobs.items())}" if knobs else ""
    return (f"Measured {meta.get('date')} on {meta.get('usable_cores')} cores{cpu}; Python {meta.get('python')}, "
            f"torch {meta.get('torch')}, pyzmq {meta.get('pyzmq')} (libzmq {meta.get('libzmq')}), "
            f"numpy {meta.get('numpy')}; ringcomm {meta.get('ringcomm')} ({meta.get('ringcomm_git')}){knob_text}.")


def collective_markdown(section: dict[str, Any]) -> str:
    """The table of one collective op: latency and bus bandwidth per system, ringcomm/gloo ratios."""
    systems = section["systems"]
    iters = sorted(set(section["iters"].values()))
    iter_text = "/".join(str(i) for i in iters)
    lines = [
        f"### {section['op']}, {section['dtype']}{' CUDA tensors' if section.get('device') == 'cuda' else ''}, "
        "one thread per rank",
        "",
        f"Median per-op time over {section['repeats']} alternating round(s) x {iter_text} timed iterations "
        f"(each iteration: the slowest rank, after a barrier); bus bandwidth = {section['busbw_formula']}. "
        "Ratios are ringcomm/gloo: latency below 1 and bus bandwidth above 1 mean ringcomm is faster; "
        "the mean-latency ratio compares mean per-op times (what a loop of ops experiences).",
        "",
    ]
    if "ringcomm-encrypted" in systems:
        lines[-2] += (" Encrypted/plain: ringcomm with RINGCOMM_ENCRYPT=1 (CURVE) over ringcomm as configured, "
                      "alternated in the same run.")
    head = ["np", "size"] + [f"{SYSTEM_LABELS[s]} ms" for s in systems] \
        + [f"{SYSTEM_LABELS[s]} GB/s" for s in systems]
    versus_gloo = "ringcomm" in systems and "gloo" in systems
    if versus_gloo:
        head += ["latency ratio", "mean-latency ratio", "bus bw ratio"]
    encrypted = "ringcomm-encrypted" in systems and "ringcomm" in systems
    if encrypted:
        head += ["encrypted/plain latency", "encrypted/plain mean latency"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in section["summary"]:
        cells = [str(row["np"]), _util.format_size(row["bytes"])]
        cells += [sig(row["systems"].get(s, {}).get("median_ms")) for s in systems]
        cells += [sig(row["systems"].get(s, {}).get("busbw_gbps")) for s in systems]
        if versus_gloo:
            ratio = row["ratio_ringcomm_over_gloo"] or {}
            cells += [sig(ratio.get("latency"), 2), sig(ratio.get("mean_latency"), 2), sig(ratio.get("busbw"), 2)]
        if encrypted:
            cost = row.get("ratio_encrypted_over_plain") or {}
            cells += [sig(cost.get("latency"), 2), sig(cost.get("mean_latency"), 2)]
        lines.append("| " + " | ".join(cells) + " |")
    for ratio in section.get("ratios", []) + section.get("bound_ratios", []):
        rounds = ", ".join(f"{x:.2f}" for x in ratio["per_round"])
        num, den = (n.replace("ddp", "DDP") for n in ratio.get("of", "ringcomm/ddp").split("/"))
        lines.append(f"\n{num} / {den} img/s at np={ratio['np']}, per round: {rounds}; "
                     f"median {ratio['median']:.2f}")
    failed = [r for r in section["runs"] if not r["ok"]]
    notes = list(section["notes"]) + [f"{len(failed)} job(s) failed; see the JSON for their errors"] * bool(failed)
    lines += [""] + [f"- {n}" for n in notes] + ([""] if notes else [])
    return "\n".join(lines)


def ceiling_markdown(section: dict[str, Any]) -> str:
    """The ceilings table."""
    msg = _util.format_size(section["message_bytes"])
    copy = section["numpy_copy"]
    lines = [
        "### Ceilings on this machine",
        "",
        f"One ZeroMQ PUSH->PULL stream between two processes, {msg} messages sent zero-copy "
        f"(median of {section['repeats']} runs of {section['count']} messages); NumPy copy of "
        f"{_util.format_size(copy['bytes'])} (bytes copied / time).",
        "",
        "| what | GB/s |",
        "|---|---|",
        f"| ZeroMQ PUSH->PULL, ipc | {sig(section['zmq']['ipc']['median_gbps'])} |",
        f"| ZeroMQ PUSH->PULL, tcp loopback | {sig(section['zmq']['tcp']['median_gbps'])} |",
        f"| NumPy {_util.format_size(copy['bytes'])} copy | {sig(copy['gbps'])} |",
        "",
    ]
    return "\n".join(lines)


def training_markdown(section: dict[str, Any]) -> str:
    """The training-step table: img/s and scaling efficiency per setup."""
    lines = [
        f"### Training step ({section['model'].split(':')[0]}, {section.get('device', 'cpu')})",
        "",
        f"Batch {section['batch_per_rank']} per rank, one thread per rank; median img/s over "
        f"{section['repeats']} alternating round(s) of {section['steps']} timed steps. "
        "Efficiency = img/s / (np x img/s of one process); spread = slowest and fastest round / median.",
        "",
        "| setup | np | img/s | scaling efficiency | spread |",
        "|---|---|---|---|---|",
    ]
    for row in section["summary"]:
        eff = "-" if row["setup"] == "single" else (f"{row['efficiency']:.0%}" if row["efficiency"] else "n/a")
        spread = "-" if not row.get("spread") else f"{row['spread'][0]:.2f}-{row['spread'][1]:.2f}"
        lines.append(f"| {row['label']} | {row['np']} | {sig(row['img_per_s'])} | {eff} | {spread} |")
    for ratio in section.get("ratios", []) + section.get("bound_ratios", []):
        rounds = ", ".join(f"{x:.2f}" for x in ratio["per_round"])
        num, den = (n.replace("ddp", "DDP") for n in ratio.get("of", "ringcomm/ddp").split("/"))
        lines.append(f"\n{num} / {den} img/s at np={ratio['np']}, per round: {rounds}; "
                     f"median {ratio['median']:.2f}")
    failed = [r for r in section["runs"] if not r["ok"]]
    notes = list(section["notes"]) + [f"{len(failed)} job(s) failed; see the JSON for their errors"] * bool(failed)
    lines += [""] + [f"- {n}" for n in notes] + ([""] if notes else [])
    return "\n".join(lines)


def markdown(results: dict[str, Any]) -> str:
    """The whole report."""
    parts = ["## ringcomm benchmark", "", machine_line(results["meta"]), ""]
    for section in results.get("collectives", {}).values():
        parts.append(collective_markdown(section))
    if "ceiling" in results:
        parts.append(ceiling_markdown(results["ceiling"]))
    if "training" in results:
        parts.append(training_markdown(results["training"]))
    if "ddp" in results:
        from . import ddp

        parts.append(ddp.markdown(results["ddp"]))
    if "backend" in results:
        from . import backend_ops

        parts.append(backend_ops.markdown(results["backend"]))
    if "frameworks" in results:
        from . import frameworks

        parts.append(frameworks.markdown(results["frameworks"]))
    if "resources" in results:
        from .resources import markdown as resources_markdown

        parts.append(resources_markdown(results["resources"]))
    if "latency" in results:
        from .latency import markdown as latency_markdown

        parts.append(latency_markdown(results["latency"]))
    if "crosshost" in results:
        from .crosshost import markdown as crosshost_markdown

        parts.append(crosshost_markdown(results["crosshost"]))
    if "cluster" in results:
        from .cluster import markdown as cluster_markdown

        parts.append(cluster_markdown(results["cluster"]))
    if "coordination" in results:
        from .coordination import format_table

        parts += ["### Rank 0's coordination work per request (simulated, pure core)", "",
                  format_table(results["coordination"]), ""]
    return "\n".join(parts).rstrip() + "\n"


def write_json(results: dict[str, Any], path: str) -> None:
    """Write ``results`` (all raw numbers) to ``path``, creating its directory."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(results, f, indent=1)
        f.write("\n")


def plot(sections: Sequence[dict[str, Any]], path: str, title: str = "") -> str | None:
    """Bus bandwidth vs size (log x), one line per system per np, one panel per op.

    Returns ``None`` on success, else why no plot was drawn (matplotlib missing, no data).
    """
    if not sections:
        return "no collective results to plot"
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib); no plot drawn"
    colors = {"ringcomm": "C0", "gloo": "C1", "horovod": "C2", "ringcomm-encrypted": "C4"}
    styles = ["-", "--", ":", "-."]
    markers = ["o", "s", "^", "D", "v", "x"]
    fig, axes = plt.subplots(1, len(sections), figsize=(6 * len(sections), 4.5), squeeze=False)
    for ax, section in zip(axes[0], sections):
        for i, np_ in enumerate(section["nps"]):
            for system in section["systems"]:
                pts = [(r["bytes"], r["systems"][system]["busbw_gbps"]) for r in section["summary"]
                       if r["np"] == np_ and system in r["systems"]]
                if not pts:
                    continue
                xs, ys = zip(*pts)
                ax.plot(xs, ys, linestyle=styles[i % len(styles)], marker=markers[i % len(markers)],
                        color=colors.get(system, "C3"), label=f"{SYSTEM_LABELS[system]} np={np_}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        sizes = section["sizes"]
        ax.set_xticks(sizes)
        ax.set_xticklabels([_util.format_size(s).replace(" ", "") for s in sizes])
        ax.set_xlabel("message size")
        ax.set_ylabel("bus bandwidth (GB/s)")
        ax.set_title(f"{section['op']} (float32)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="small")
    if title:
        fig.suptitle(title, fontsize="small")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None
