"""Figures and printed summaries of ``bench_train_loop_gpu.py`` (imported by it)."""

from __future__ import annotations

from typing import Any

import numpy as np

PHASES = ((1, 2), (3, 5), (6, 15), (16, 30), (31, 100), (101, 10**9))
"""Buckets of steps since the last dump that normal steps are reported by: dump work still
running in the background shows in the early ones."""

STRESS = {"mean": 1.03, "p99": 1.10}
"""Targets at the stress cadence (a dump every 50 steps)."""
REALISTIC = {"mean": 1.01, "p99": 1.05}
"""Targets at the cadences users run (every 1,000 steps, every 30 s)."""


def stats(ms: list[float]) -> dict[str, float]:
    if not ms:
        return {}
    a = np.asarray(ms)
    return {
        "n": len(ms),
        "mean": float(a.mean()),
        "median": float(np.median(a)),
        "p99": float(np.percentile(a, 99)),
        "max": float(a.max()),
    }


def _hooked(runs: list[dict], key: str) -> list[Any]:
    return [x for r in runs if r["hooked"] for x in r[key]]


def summarize(runs: list[dict], holds: list[float], targets: dict[str, float]) -> dict[str, Any]:
    """Step figures of the blocks ``runs`` (those without the hook and those of one copy mode).

    ``with_all`` holds every step with the hook (dump steps in): its mean and p99 are the
    ratios' numerators; ``with_normal`` the steps with the hook that took no dump.
    """
    base = [x for r in runs if not r["hooked"] for x in r["steps"]]
    hooked, dumps = _hooked(runs, "steps"), _hooked(runs, "dump_steps")
    checks = _hooked(runs, "checks")
    b, h, w = stats(base), stats(hooked), stats(hooked + dumps)
    over = [x for x in hooked if x > 2 * b["median"]]
    offsets = _hooked(runs, "offsets")
    gcs = {
        k: [g for r in runs if r["hooked"] == (k == "with") for g in r["gc"]]
        for k in ("with", "without")
    }
    mean_ratio, p99_ratio = w["mean"] / b["mean"], w["p99"] / b["p99"]
    dump_max = max(dumps) / h["median"] if dumps else None
    return {
        "targets": targets,
        "without": b,
        "with_normal": h,
        "with_all": w,
        "dump_steps": stats(dumps),
        "mean_ratio": mean_ratio,
        "p99_ratio": p99_ratio,
        "max_ratio": w["max"] / b["max"],
        "normal_mean_ratio": h["mean"] / b["mean"],
        "steps_over_2x_median": len(over),
        "base_steps_over_2x_median": sum(x > 2 * b["median"] for x in base),
        "worst_normal_over_median": max(hooked) / b["median"],
        "dump_step_over_normal": dump_max,
        "dump_step_median_over_normal": float(np.median(dumps)) / h["median"] if dumps else None,
        "met": {
            "mean": mean_ratio <= targets["mean"],
            "p99": p99_ratio <= targets["p99"],
            "no_normal_step_over_2x": not over,
            "dump_step_1_5x": dump_max is not None and dump_max <= 1.5,
            "bit_exact": bool(checks) and all(c["ok"] for c in checks),
        },
        "after_dump": {  # normal steps with the hook by steps since the last dump
            (f"{lo}-{hi}" if hi < 10**9 else f"{lo}+"): stats(
                [x for x, o in zip(hooked, offsets, strict=True) if lo <= o <= hi]
            )
            for lo, hi in PHASES
        },
        "blocks": [  # each block in the order run: its normal steps
            {
                "hooked": r["hooked"],
                "dumps": len(r["dump_steps"]),
                **stats(r["steps"]),
                "worst_at": int(np.argmax(r["steps"])),
                "parts_ms": r.get("parts_ms", []),
                "after_ms": r.get("after_ms", {}),
            }
            for r in runs
        ],
        "dump_at": _hooked(runs, "dump_at"),
        "hold_ms": stats([x * 1e3 for x in holds]),
        "dump_wall_ms": stats([x * 1e3 for x in _hooked(runs, "dump_wall")]),
        "dump_cpu_ms": stats([x * 1e3 for x in _hooked(runs, "dump_cpu")]),
        "dump_prepare_ms": stats([x * 1e3 for x in _hooked(runs, "dump_prepare")]),
        "dump_tables_ms": stats([x * 1e3 for x in _hooked(runs, "dump_tables")]),
        "commit_s": stats([c["commit_s"] for c in checks]),
        "rows_per_dump": [c["rows"] for c in checks],
        "check_s": stats([c["check_s"] for c in checks]),
        "dumps_checked": len(checks),
        "dumps_graphed": sum(r["graphed"] for r in runs if r["hooked"]),
        "dumps_ok": sum(c["ok"] for c in checks),
        "drain_s": [r["drain_s"] for r in runs if r["hooked"]],
        "gc": {
            k: {
                "count": len(v),
                "gen2": sum(g == 2 for g, _ in v),
                "max_ms": max((s * 1e3 for _, s in v), default=0.0),
            }
            for k, v in gcs.items()
        },
    }


def report(name: str, s: dict[str, Any]) -> None:
    """Print the summary of one loop / ids / copy mode."""
    b, w, h, dm, t = s["without"], s["with_all"], s["with_normal"], s["dump_steps"], s["targets"]
    print(f"== {name}: MLP {s['mlp_layers']} layers, blocks {s['block_steps']}")
    for label, x, note in (
        ("without hook", b, ""),
        ("with hook", w, ", dump steps in"),
        ("normal steps", h, ""),
    ):
        print(
            f"  {label:<14} mean {x['mean']:6.2f}  median {x['median']:6.2f}  "
            f"p99 {x['p99']:6.2f}  max {x['max']:6.2f} ms  ({x['n']} steps{note})"
        )
    print(
        f"  ratios         mean {s['mean_ratio']:.3f} (<= {t['mean']})  p99 "
        f"{s['p99_ratio']:.3f} (<= {t['p99']})  normal steps > 2x median "
        f"{s['steps_over_2x_median']} (0; without the hook: {s['base_steps_over_2x_median']})  "
        f"worst normal {s['worst_normal_over_median']:.2f}x median"
    )
    if dm:
        print(
            f"  dump steps     mean {dm['mean']:6.2f}  median {dm['median']:6.2f}  max "
            f"{dm['max']:6.2f} ms ({dm['n']} dumps at hooked steps {s['dump_at'][:6]}): "
            f"{s['dump_step_over_normal']:.2f}x normal (<= 1.5), median "
            f"{s['dump_step_median_over_normal']:.2f}x; hold median "
            f"{s['hold_ms'].get('median', 0):.2f} ms; training thread wall median "
            f"{s['dump_wall_ms'].get('median', 0):.2f}, CPU {s['dump_cpu_ms'].get('median', 0):.2f}"
            f" ms (prepare {s['dump_prepare_ms'].get('median', 0):.2f}, tables "
            f"{s['dump_tables_ms'].get('median', 0):.2f})"
        )
    blocks = "  ".join(
        f"{'H' if x['hooked'] else 'b'}{x['dumps'] or ''} {x['mean']:.2f}/{x['max']:.1f}"
        f"@{x['worst_at']}"
        for x in s["blocks"]
    )
    print(f"  blocks in order (mean/max@step): {blocks}")
    parts = "  ".join(
        f"{'H' if x['hooked'] else 'b'} " + "/".join(f"{v:.3f}" for v in x["parts_ms"])
        for x in s["blocks"]
        if x.get("parts_ms")
    )
    print(f"  normal steps' host ms, record/step/after_step, by block: {parts}")
    after = "  ".join(
        f"{a['absorb']:.3f} ({a['absorb_n']}) / {a['other']:.3f}"
        for x in s["blocks"]
        if x["hooked"] and (a := x.get("after_ms"))
    )
    print(f"  hooked blocks' after_step ms, marking steps (n) / other steps: {after}")
    phases = "  ".join(
        f"{k}: {v['mean']:.2f} ({v['n']})" for k, v in s["after_dump"].items() if v.get("n")
    )
    print(f"  normal steps by steps since the dump: mean ms (steps)  {phases}")
    c = s["commit_s"]
    print(
        f"  commit latency median {c.get('median', 0):.2f} max {c.get('max', 0):.2f} s; rows "
        f"per dump {s['rows_per_dump'][:6]}; bit-exact {s['dumps_ok']}/{s['dumps_checked']} "
        f"({s['dumps_graphed']} graphed); drain {[round(x, 2) for x in s['drain_s']]} s; "
        f"gc {s['gc']}; met {s['met']}",
        flush=True,
    )


COMPACTION = {"mean": 1.01, "p99": 1.01}
"""Targets of steps during a compaction against the hooked steps without one."""


def summarize_compaction(runs: list[dict]) -> dict[str, Any]:
    """Normal steps during a background compaction against the hooked steps without one.

    ``runs`` are one loop / ids' blocks; those with ``compacting`` hold ``step_spans`` (each
    normal step's start and end) and ``compactions`` (the compactor's spans of that block).
    A step is during a compaction if its span overlaps one. The ratios divide the steps during
    a compaction by the normal steps of the hooked blocks without compaction (``hooked``) and
    by the steps of the compaction blocks that overlapped none (``outside``).
    """
    hooked = [x for r in runs if r["hooked"] and not r["compacting"] for x in r["steps"]]
    during: list[float] = []
    outside: list[float] = []
    spans: list[tuple[float, float]] = []
    checks, failures, share = [], 0, []
    for r in (r for r in runs if r["compacting"]):
        c = r["compactions"]
        spans += c["spans"]
        failures = c["failures"]
        checks += r["checks"]
        for ms, (a, b) in zip(r["steps"], r["step_spans"], strict=True):
            hit = any(a < e and b > s for s, e in c["spans"])
            (during if hit else outside).append(ms)
        if r["step_spans"]:
            lo, hi = r["step_spans"][0][0], r["step_spans"][-1][1]
            busy = sum(max(0.0, min(e, hi) - max(s, lo)) for s, e in c["spans"])
            share.append(busy / (hi - lo))
    h, d, o = stats(hooked), stats(during), stats(outside)
    out: dict[str, Any] = {
        "hooked": h,
        "during": d,
        "outside": o,
        "compactions": len(spans),
        "compaction_s": [round(e - s, 3) for s, e in spans],
        "compacting_share": share,
        "failures": failures,
        "dumps_checked": len(checks),
        "dumps_ok": sum(c["ok"] for c in checks),
        "wait_s": [round(r["compactions"]["wait_s"], 2) for r in runs if r["compacting"]],
    }
    if d and h:
        for k in ("mean", "p99"):
            out[f"{k}_ratio"] = d[k] / h[k]
            out[f"{k}_ratio_outside"] = d[k] / o[k] if o else None
        out["met"] = {k: out[f"{k}_ratio"] <= t for k, t in COMPACTION.items()}
    return out


def report_compaction(c: dict[str, Any]) -> None:
    """Print :func:`summarize_compaction`'s figures."""
    for label in ("hooked", "during", "outside"):
        x = c[label]
        if x:
            print(
                f"  {label + ' compaction' if label != 'hooked' else 'hooked, no compaction':<22}"
                f" mean {x['mean']:6.2f}  median {x['median']:6.2f}  p99 {x['p99']:6.2f}  "
                f"max {x['max']:6.2f} ms  ({x['n']} steps)"
            )
    if "mean_ratio" in c:
        outside = "  ".join(
            f"{k} {c[f'{k}_ratio_outside']:.3f}"
            for k in ("mean", "p99")
            if c[f"{k}_ratio_outside"] is not None
        )
        print(
            f"  during / hooked   mean {c['mean_ratio']:.3f}  p99 {c['p99_ratio']:.3f} "
            f"(<= {COMPACTION['mean']}); during / outside {outside or '-'}; met {c['met']}"
        )
    print(
        f"  compactions {c['compactions']} ({c['failures']} failed), s: {c['compaction_s']}; "
        f"compacting share of the blocks {[round(x, 3) for x in c['compacting_share']]}; "
        f"waited after the blocks {c['wait_s']} s; bit-exact {c['dumps_ok']}/{c['dumps_checked']}",
        flush=True,
    )
