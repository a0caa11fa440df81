"""A sweep's report: the summary table printed at the end of a sweep, its headline numbers, and
``report.html``, one self-contained page (figures embedded as base64 PNG) with the command, the
config, the table, every figure and the cells' MLflow run ids, each a link to its run in the UI."""

from __future__ import annotations

import base64
import html
import re
import math
from pathlib import Path
from typing import Mapping, Sequence

import pandas as pd

# The columns that tell the cells of a sweep apart, in the order the table shows them.
CELL_KEYS = ("N", "eps", "T", "attack_c", "attack_p")


def cell_keys(results: pd.DataFrame) -> list[str]:
    """The cell columns whose value varies across the rows (N, eps, T, c, p)."""
    return [k for k in CELL_KEYS if k in results and results[k].astype(str).nunique() > 1]


def summary_table(results: pd.DataFrame, y: str, labels: dict[str, str] | None = None) -> pd.DataFrame:
    """One row per cell (in the order of ``results``: the sweep grid's), one column per method:
    ``<label>`` "mean (sd)" of ``y`` across trials (``<label>, <coupling> noise`` per coupling of a
    private method under an attack). The first columns are the cell keys."""
    labels = labels or {}
    keys = cell_keys(results) or ["N"]
    df = results[results[f"{y}_mean"].notna()].copy()
    df["column"] = [labels.get(m, m) + (f", {c} noise" if c in ("independent", "shared") else "")
                    for m, c in zip(df["method"], df["coupling"])]
    columns = list(dict.fromkeys(df["column"]))
    rows = []
    for key, group in df.groupby(keys, sort=False, dropna=False):
        key = key if isinstance(key, tuple) else (key,)
        row = {_KEY_NAMES.get(k, k): _fmt_key(v) for k, v in zip(keys, key)}
        by_column = {r.column: r for r in group.itertuples()}
        for c in columns:
            r = by_column.get(c)
            row[c] = "" if r is None else f"{getattr(r, f'{y}_mean'):.4g} ({getattr(r, f'{y}_sd'):.2g})"
        rows.append(row)
    return pd.DataFrame(rows)


_KEY_NAMES = {"attack_c": "c", "attack_p": "p"}


def _fmt_key(value) -> str:
    if isinstance(value, float):
        return "" if math.isnan(value) else f"{value:g}"
    return str(value)


def text_table(table: pd.DataFrame) -> str:
    """The table as fixed-width text for the console."""
    cols = list(table.columns)
    widths = [max(len(str(c)), *(len(str(v)) for v in table[c])) for c in cols]
    lines = ["  ".join(str(c).rjust(w) for c, w in zip(cols, widths))]
    lines += ["  ".join(str(v).rjust(w) for v, w in zip(row, widths)) for row in table.itertuples(index=False)]
    return "\n".join(lines)


def markdown_table(table: pd.DataFrame) -> str:
    """The table in Markdown (MLflow renders a run's description as Markdown)."""
    lines = ["| " + " | ".join(map(str, table.columns)) + " |", "|" + "---|" * len(table.columns)]
    lines += ["| " + " | ".join(map(str, row)) + " |" for row in table.itertuples(index=False)]
    return "\n".join(lines) + "\n"


def headline(results: pd.DataFrame, y: str) -> dict[str, float]:
    """Per method (and coupling): the best (smallest) and worst (largest) cell mean of ``y``:
    ``<method>.best_<y>``, ``<method>.worst_<y>``."""
    out = {}
    df = results[results[f"{y}_mean"].notna()]
    for (method, coupling), rows in df.groupby([df["method"], df["coupling"].fillna("")], sort=False):
        key = method + (f".{coupling}" if coupling not in ("", "none") else "")
        out[f"{key}.best_{y}"] = float(rows[f"{y}_mean"].min())
        out[f"{key}.worst_{y}"] = float(rows[f"{y}_mean"].max())
    return out


def grid(overrides: Sequence[Sequence[str]]) -> dict[str, list[str]]:
    """The values each override key takes across the cells, in order of first appearance."""
    values: dict[str, list[str]] = {}
    for job in overrides:
        for override in job:
            key, _, value = override.partition("=")
            if value not in values.setdefault(key, []):
                values[key].append(value)
    return values


COMPUTE = {"device_name": "device", "seconds": "seconds", "seconds_per_epoch": "s / epoch",
           "peak_memory_gb": "peak memory (GiB)"}  # a cell record's compute keys, as the cells table heads them


def _compute_value(value) -> str:
    if value is None:
        return ""
    return f"{value:.3g}" if isinstance(value, float) else str(value)


VOLATILE = ("<!--volatile-->", "<!--/volatile-->")  # what differs from one rebuild to the next (run ids, timings)


def stable(page: str) -> str:
    """``page`` without its volatile parts (the MLflow run ids and the cells' timings, marked by
    ``write_html``): the copy in ``report.dir`` that DVC hashes, byte-identical from one rebuild of
    an unchanged stage to the next. The sweep folder's and MLflow's copy keep everything."""
    start, end = map(re.escape, VOLATILE)
    return re.sub(f"{start}.*?{end}", "<p>(the cells' MLflow run ids and timings: in the sweep folder's report.html "
                                      "and the parent run's artifacts)</p>", page, flags=re.S)


def _swept_note(swept: dict[str, list[str]] | None) -> list[str]:
    """A paragraph naming each key the cells vary and its values (the config below is the first
    cell's: an N = 1000,2000 sweep's shows N: 1000), or nothing for a single cell."""
    varied = {key: values for key, values in (swept or {}).items() if len(values) > 1}
    if not varied:
        return []
    items = "".join(f"<li><code>{html.escape(key)}</code>: {html.escape(', '.join(values))}</li>"
                    for key, values in varied.items())
    return [f"<p>The first cell's config; across the cells these keys take the values:</p><ul>{items}</ul>"]


def write_html(path: Path, title: str, command: str, config_yaml: str, table: pd.DataFrame,
               figures: Sequence[Path], runs: Sequence[tuple[str, str, dict]], parent: str | None = None,
               caption: str = "mean (sd) across trials, one row per cell in sweep order",
               swept: dict[str, list[str]] | None = None, tables: Sequence[tuple[str, pd.DataFrame]] = (),
               captions: Mapping[str, str] | None = None, links: Mapping[str, str] | None = None,
               links_note: str | None = None) -> Path:
    """``report.html``: self-contained (every figure inlined), readable without a server. ``runs``:
    per cell, its name, MLflow run id and what it ran on (``Cell.finished``'s ``compute``): the
    cells table shows the device (its name, and the torch device: ``cuda:0``), the cell's
    seconds, seconds per epoch (DPFormer) and peak memory (of the GPU; on the CPU, the process's
    peak resident set). ``swept`` (``grid`` of the cells' overrides): the keys the cells vary, said
    above the config, which is the first cell's. ``tables``: more tables after the results, each
    with its caption (the paired gains and their verdicts); ``captions``: what a figure shows and
    what its bars are, by the figure's file name. ``links``: run id -> its page in the MLflow UI
    (``pipeline.sweep.run_links``): the cells' run ids (and the parent's) are links, said by
    ``links_note``."""
    esc = html.escape
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<title>{esc(title)}</title><style>body{{font-family:sans-serif;max-width:1200px;margin:1em auto;}}"
        "table{border-collapse:collapse;font-size:13px}td,th{border:1px solid #ccc;padding:2px 6px;text-align:right}"
        "pre{background:#f6f6f6;padding:8px;font-size:12px;white-space:pre-wrap;word-break:break-all}img{max-width:100%}</style></head><body>",
        f"<h1>{esc(title)}</h1>",
    ]
    links = links or {}

    def run_id_cell(run_id: str) -> str:
        code = f"<code>{esc(run_id)}</code>"
        return f"<a href='{esc(links[run_id], quote=True)}'>{code}</a>" if run_id in links else code

    if parent:
        parts.append(f"{VOLATILE[0]}<p>MLflow parent run: {run_id_cell(parent)}</p>{VOLATILE[1]}")
    parts += [f"<h2>Command</h2><pre>{esc(command)}</pre>",
              f"<h2>Results</h2><p>{esc(caption)}</p>",
              table.to_html(index=False, escape=True, border=0, classes="results")]
    for text, extra in tables:
        parts += [f"<p>{esc(text)}</p>", extra.to_html(index=False, escape=True, border=0, classes="results")]
    parts.append("<h2>Figures</h2>")
    for fig in figures:
        data = base64.b64encode(Path(fig).read_bytes()).decode("ascii")
        name = Path(fig).name
        said = f"{name}: {(captions or {})[name]}" if name in (captions or {}) else name
        parts.append(f"<figure><img alt='{esc(Path(fig).stem)}' src='data:image/png;base64,{data}'>"
                     f"<figcaption>{esc(said)}</figcaption></figure>")
    shown = [k for k in COMPUTE if any(compute.get(k) is not None for _, _, compute in runs)]
    said = f"<p>{esc(links_note)}</p>" if links and links_note else ""
    parts.append(f"<h2>Cells</h2>{VOLATILE[0]}{said}<table class='runs'><tr><th>cell</th><th>MLflow run id</th>"
                 + "".join(f"<th>{esc(COMPUTE[k])}</th>" for k in shown) + "</tr>")
    for name, run_id, compute in runs:
        where = {**compute, "device_name": f"{compute.get('device_name', '')} ({compute['device']})"
                 if compute.get("device") else compute.get("device_name")}
        parts.append(f"<tr><td>{esc(name)}</td><td>{run_id_cell(run_id)}</td>"
                     + "".join(f"<td>{esc(_compute_value(where.get(k)))}</td>" for k in shown) + "</tr>")
    parts += [f"</table>{VOLATILE[1]}", "<h2>Config</h2>", *_swept_note(swept), f"<pre>{esc(config_yaml)}</pre>", "</body></html>"]
    path = Path(path)
    path.write_text("\n".join(parts), encoding="utf-8")
    return path
