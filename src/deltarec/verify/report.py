"""Human outputs of a verification: a rich summary table and a self-contained HTML report.

The HTML page has no external resource (no script, stylesheet, font or image is fetched): the
styles are inline and the freshness plot is an inline SVG, so the file can be archived as a
pipeline artifact and opened anywhere.
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence

from rich.console import Console
from rich.table import Table

from deltarec.stats import quantile
from deltarec.verify.types import (
    CLASS_ORDER,
    FAILING_CLASSES,
    DumpFreshness,
    Mismatch,
    VerifyResult,
)

_COLORS = {
    "MATCH": "#2e7d32",
    "DIFFERENT": "#c62828",
    "MISSING": "#ef6c00",
    "UNEXPECTED": "#6a1b9a",
    "SUPERSEDED": "#1565c0",
}


# ---- rich -------------------------------------------------------------------------------------
def print_summary(result: VerifyResult, console: Console | None = None) -> None:
    """Print the per-table counts, the verdict and the worst mismatches."""
    console = console or Console()
    title = (
        f"verify run {result.run!r} generation {result.generation} "
        f"through dump {result.through_seq} ({result.mode})"
    )
    table = Table(title=title)
    table.add_column("table", no_wrap=True)
    table.add_column("checked", justify="right")
    for c in CLASS_ORDER:
        table.add_column(c.value, justify="right", style="red" if c in FAILING_CLASSES else None)
    table.add_column("max |diff|", justify="right")
    rows = sorted(result.tables.items())
    for name, t in rows:
        table.add_row(
            name,
            str(t.checked),
            *(str(t.counts[c]) for c in CLASS_ORDER),
            _fmt_diff(t.max_abs_diff),
        )
    if fits(console, table):
        console.print(table)
    else:  # narrower than the table (80 columns, piped): one line per table, names whole
        console.print(title, soft_wrap=True, highlight=False)
        for name, t in rows:
            counts = ", ".join(f"{c.value} {t.counts[c]}" for c in CLASS_ORDER if t.counts[c])
            line = f"  {name}: {t.checked} checked ({counts or 'none'})"
            console.print(f"{line}, max |diff| {_fmt_diff(t.max_abs_diff)}", soft_wrap=True)
    console.print(
        f"shards checked: {result.shards_checked}, failed: {len(result.shard_failures)}; "
        f"{result.checked} keys in {result.duration_s:.2f}s"
    )
    # paths and keys are copied into other commands: long lines wrap softly, never cut
    for f in result.shard_failures:
        console.print(f"[red]shard {f.path}: {f.problem}[/red]", highlight=False, soft_wrap=True)
    for e in result.errors:
        console.print(f"[red]error: {e}[/red]", highlight=False, soft_wrap=True)
    for note in result.notes:
        console.print(f"note: {note}", highlight=False, soft_wrap=True)
    worst = _worst(result, 10)
    if worst:
        console.print("worst mismatches:")
        for m in worst:
            console.print(f"  {_mismatch_line(m)}", highlight=False, soft_wrap=True)
    verdict = "[green]PASSED[/green]" if result.passed else "[red]FAILED[/red]"
    console.print(f"verdict: {verdict}")


def fits(console: Console, table: Table) -> bool:
    """Whether ``table`` fits the console's width without folding or cutting a cell."""
    from rich.measure import Measurement

    wide = console.options.update_width(1 << 20)  # measured unclamped, then compared
    return Measurement.get(console, wide, table).maximum <= console.width


def _fmt_diff(x: float | None) -> str:
    if x is None:
        return "-"
    return "NaN" if math.isnan(x) else f"{x:.3g}"


def _worst(result: VerifyResult, limit: int) -> list[Mismatch]:
    every = [m for t in result.tables.values() for m in t.mismatches]
    return sorted(every, key=Mismatch.severity, reverse=True)[:limit]


def _mismatch_line(m: Mismatch) -> str:
    return (
        f"{m.row_class.value} table {m.table!r} key {m.key}: {m.reason} "
        f"(expected version {m.expected_version}, store version {m.store_version}, "
        f"max |diff| {_fmt_diff(m.max_abs_diff)})"
    )


# ---- HTML -------------------------------------------------------------------------------------
_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:2em;
color:#222}
h1{font-size:1.4em}h2{font-size:1.15em;margin-top:1.6em}
table{border-collapse:collapse;margin:.5em 0}
th,td{border:1px solid #ccc;padding:.25em .6em;text-align:right}
th:first-child,td:first-child{text-align:left}
th{background:#f3f3f3}
.pass{color:#2e7d32;font-weight:bold}.fail{color:#c62828;font-weight:bold}
.bad{background:#fdecea}.muted{color:#777}
code{font-family:ui-monospace,Menlo,Consolas,monospace}
"""


def render_html(result: VerifyResult) -> str:
    """A self-contained HTML page: verdict, per-table counts, worst mismatches, freshness plot."""
    e = html.escape
    verdict = (
        '<span class="pass">PASSED</span>'
        if result.passed
        else f'<span class="fail">FAILED</span>: {e(result.failure_summary())}'
    )
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>deltarec verify {e(result.run)} generation {result.generation}</title>",
        f"<style>{_CSS}</style></head><body>",
        f"<h1>deltarec verify: run <code>{e(result.run)}</code>, generation "
        f"{result.generation}, through dump {result.through_seq}</h1>",
        f"<p>Verdict: {verdict}</p>",
        "<p class='muted'>"
        f"store <code>{e(result.store)}</code> &middot; mode {e(result.mode)}"
        f"{'' if result.sample is None else f' (sample {result.sample} per table)'}"
        f" &middot; seed {result.seed} &middot; started {e(result.started_at)}"
        f" &middot; {result.checked} keys in {result.duration_s:.2f}s"
        f" &middot; shards checked {result.shards_checked}</p>",
        _counts_table(result),
        _shard_section(result),
        _mismatch_section(result),
        "<h2>Freshness per dump</h2>",
        freshness_svg(result.dumps),
        _dump_table(result.dumps),
        "</body></html>",
    ]
    return "\n".join(p for p in parts if p)


def _counts_table(result: VerifyResult) -> str:
    e = html.escape
    head = "".join(f"<th>{c.value}</th>" for c in CLASS_ORDER)
    rows = []
    for name, t in sorted(result.tables.items()):
        cells = "".join(
            f'<td class="{"bad" if c in FAILING_CLASSES and t.counts[c] else ""}">'
            f"{t.counts[c]}</td>"
            for c in CLASS_ORDER
        )
        rows.append(
            f"<tr><td><code>{e(name)}</code></td><td>{e(t.dtype)}</td><td>{t.dim}</td>"
            f"<td>{t.expected_keys}</td><td>{t.checked}</td>{cells}"
            f"<td>{_fmt_diff(t.max_abs_diff)}</td></tr>"
        )
    return (
        "<h2>Per-table counts</h2><table><tr><th>table</th><th>dtype</th><th>dim</th>"
        f"<th>expected keys</th><th>checked</th>{head}<th>max |diff|</th></tr>"
        + "".join(rows)
        + "</table>"
    )


def _shard_section(result: VerifyResult) -> str:
    e = html.escape
    items = [
        f"<li><code>{e(f.path)}</code> (table <code>{e(f.table)}</code>, rank {f.rank}, "
        f"generation {f.generation} dump {f.seq}): {e(f.problem)}</li>"
        for f in result.shard_failures
    ]
    items += [f"<li>{e(err)}</li>" for err in result.errors]
    if not items:
        return ""
    return "<h2>Artifact failures</h2><ul class='fail'>" + "".join(items) + "</ul>"


def _mismatch_section(result: VerifyResult) -> str:
    e = html.escape
    worst = _worst(result, 50)
    if not worst:
        return "<h2>Worst mismatches</h2><p>None.</p>"
    rows = "".join(
        f"<tr><td><code>{e(m.table)}</code></td><td>{m.key}</td>"
        f'<td style="color:{_COLORS[m.row_class.value]}">{m.row_class.value}</td>'
        f"<td>{e(m.reason)}</td><td>{m.expected_version}</td><td>{m.store_version}</td>"
        f"<td>{_fmt_diff(m.max_abs_diff)}</td><td>{_fmt_diff(m.tolerance)}</td></tr>"
        for m in worst
    )
    return (
        "<h2>Worst mismatches</h2><table><tr><th>table</th><th>key</th><th>class</th>"
        "<th>reason</th><th>expected version</th><th>store version</th><th>max |diff|</th>"
        f"<th>tolerance</th></tr>{rows}</table>"
    )


def _dump_table(dumps: Sequence[DumpFreshness]) -> str:
    if not dumps:
        return "<p>No committed dump.</p>"
    rows = "".join(
        f"<tr><td>{d.generation}</td><td>{d.seq}</td><td>{html.escape(d.kind)}</td>"
        f"<td>{d.first_step}&ndash;{d.last_step}</td><td>{d.rows}</td>"
        f"<td>{html.escape(d.created_at)}</td><td>{_fmt_age(d.age_s)}</td>"
        f"<td>{_fmt_lag(d.lag_s)}</td><td>{d.live_rows}</td></tr>"
        for d in dumps
    )
    return (
        "<table><tr><th>generation</th><th>dump</th><th>kind</th><th>steps</th><th>rows</th>"
        "<th>committed</th><th>age at verify</th><th>publish lag</th>"
        "<th>checked keys served from it</th></tr>"
        f"{rows}</table>"
    )


def _fmt_lag(lag: float | None) -> str:
    return "-" if lag is None or not math.isfinite(lag) else f"{lag:.2f}s"


def _fmt_age(age: float | None) -> str:
    if age is None:
        return "-"
    if age < 120:
        return f"{age:.0f}s"
    if age < 7200:
        return f"{age / 60:.1f}min"
    return f"{age / 3600:.1f}h"


def freshness_svg(dumps: Sequence[DumpFreshness], width: int = 720, height: int = 260) -> str:
    """An inline SVG of freshness per dump.

    Bars (left axis): the dump's freshness in seconds, from its training step (the moment the
    dump was taken; the commit for dumps without ``taken_at``) until its rows were visible in
    the store, from the store's freshness records; dashed lines mark the p50 and p99 over the
    dumps shown. Line (right axis): how many of the checked keys serving holds from that dump,
    which shows where serving's rows come from.
    """
    if not dumps:
        return '<svg xmlns="http://www.w3.org/2000/svg" width="10" height="10"></svg>'
    left, right, top, bottom = 60, 60, 20, 50
    pw, ph = width - left - right, height - top - bottom
    n = len(dumps)
    slot = pw / n
    lags = [d.lag_s for d in dumps]
    max_lag = max([x for x in lags if x is not None and math.isfinite(x)] or [0.0]) or 1.0
    max_live = max(max(d.live_rows for d in dumps), 1)
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" role="img" '
        'aria-label="freshness per dump: publish lag and rows served per dump">',
        f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="#fafafa" stroke="#ccc"/>',
    ]
    for i, d in enumerate(dumps):
        cx = left + (i + 0.5) * slot
        if d.lag_s is not None and math.isfinite(d.lag_s):
            h = ph * max(d.lag_s, 0.0) / max_lag
            out.append(
                f'<rect x="{cx - slot * 0.35:.1f}" y="{top + ph - h:.1f}" '
                f'width="{slot * 0.7:.1f}" height="{h:.1f}" fill="#1565c0" opacity="0.75">'
                f"<title>generation {d.generation} dump {d.seq}: visible {d.lag_s:.2f}s after "
                "its training step</title></rect>"
            )
        if n <= 40 or i % max(1, n // 20) == 0:
            out.append(
                f'<text x="{cx:.1f}" y="{top + ph + 14}" font-size="10" '
                f'text-anchor="middle">{d.generation}.{d.seq}</text>'
            )
    points = [
        (left + (i + 0.5) * slot, top + ph - ph * d.live_rows / max_live, d)
        for i, d in enumerate(dumps)
    ]
    out.append(
        '<polyline points="'
        + " ".join(f"{x:.1f},{y:.1f}" for x, y, _ in points)
        + '" fill="none" stroke="#ef6c00" stroke-width="2"/>'
    )
    out += [
        f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3" fill="#ef6c00"><title>generation '
        f"{d.generation} dump {d.seq}: {d.live_rows} checked keys served</title></circle>"
        for x, y, d in points
    ]
    known = sorted(x for x in lags if x is not None and math.isfinite(x))
    for name, q, dash in (("p50", 0.50, "4 3"), ("p99", 0.99, "1 3")):
        if known:
            value = quantile(known, q)
            y = top + ph - ph * max(value, 0.0) / max_lag
            out.append(
                f'<line x1="{left}" y1="{y:.1f}" x2="{left + pw}" y2="{y:.1f}" '
                f'stroke="#0d47a1" stroke-dasharray="{dash}"/>'
                f'<text x="{left + 4}" y="{y - 3:.1f}" font-size="10" fill="#0d47a1">'
                f"{name} {value:.2f}s</text>"
            )
    if all(x is None for x in lags):
        out.append(
            f'<text x="{left + pw / 2}" y="{top + ph / 2}" font-size="12" text-anchor="middle" '
            'fill="#777">the store holds no freshness record for these dumps</text>'
        )
    out += [
        f'<text x="{left - 6}" y="{top + 10}" font-size="10" text-anchor="end">'
        f"{max_lag:.3g}s</text>",
        f'<text x="{left - 6}" y="{top + ph}" font-size="10" text-anchor="end">0</text>',
        f'<text x="{left + pw + 6}" y="{top + 10}" font-size="10">{max_live} keys</text>',
        f'<text x="{left + pw / 2}" y="{height - 16}" font-size="11" text-anchor="middle">'
        "dump (generation.seq)</text>",
        f'<text x="{left}" y="{height - 2}" font-size="10" fill="#1565c0">'
        "bars: freshness, training step to visible (s)</text>",
        f'<text x="{left + pw}" y="{height - 2}" font-size="10" fill="#ef6c00" '
        'text-anchor="end">line: checked keys served from the dump</text>',
        "</svg>",
    ]
    return "".join(out)
