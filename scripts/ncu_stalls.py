"""Warp-stall samples of one kernel from ncu's SASS source page, summed three ways (a diagnostic for device-call
output, e.g. scripts/device/call_N4.sh / call_P1.sh):
  - by stall reason over the whole kernel;
  - the instructions with the most samples, each with its top reasons;
  - by stretches of `--bucket` consecutive instructions, to find the code regions (prologue, gather, norm, chunk
    loop, split-K finish) that hold the time.

    ncu --set full --import-source no -k regex:NAME --launch-count 1 -o rep python3 prog.py
    ncu --import rep.ncu-rep --page source --csv --print-source sass | gzip -c > rep.sass.csv.gz
    python3 scripts/ncu_stalls.py rep.sass.csv.gz [--top 25] [--bucket 100] [--min-share 0.5]
"""

from __future__ import annotations

import argparse
import collections
import csv
import gzip
import sys

SAMPLES = "Warp Stall Sampling (All Samples)"


def read_rows(path: str) -> tuple[list[str], list[list[str]]]:
    """The header and the instruction rows of the first kernel in the CSV (gzip or plain)."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", newline="") as f:
        rows = list(csv.reader(f))
    try:
        start = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
    except StopIteration:
        raise SystemExit(f"{path}: no 'Address' header (not an ncu --page source --csv export?)") from None
    header = rows[start]
    body = []
    for r in rows[start + 1:]:
        if len(r) != len(header):
            break  # the next kernel's section, or the end
        body.append(r)
    return header, body


def count(value: str) -> int:
    return int(value) if value.isdigit() else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=25, help="instructions listed by samples")
    ap.add_argument("--bucket", type=int, default=100, help="instructions per region")
    ap.add_argument("--min-share", type=float, default=0.5, help="regions below this % of the samples are not shown")
    args = ap.parse_args()
    header, body = read_rows(args.csv)
    col = {h: i for i, h in enumerate(header)}
    if SAMPLES not in col:
        raise SystemExit(f"{args.csv}: no '{SAMPLES}' column (profile with --set full or the SourceCounters section)")
    reasons = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
    total = collections.Counter()
    for r in body:
        for h in reasons:
            total[h] += count(r[col[h]])
    n = sum(total.values()) or 1
    print(f"{args.csv}: {len(body)} instructions, {sum(total.values())} stall samples")
    for h, v in total.most_common(12):
        print(f"  {h[6:]:22s} {v:8d} {100 * v / n:5.1f}%")

    def top_reasons(r: list[str], k: int = 3) -> str:
        best = sorted(((count(r[col[h]]), h[6:]) for h in reasons), reverse=True)[:k]
        return " ".join(f"{name}={v}" for v, name in best if v)

    print(f"top {args.top} instructions (index, samples, executed, SASS, reasons):")
    ranked = sorted(range(len(body)), key=lambda i: -count(body[i][col[SAMPLES]]))
    executed = col.get("Instructions Executed")
    for i in ranked[: args.top]:
        r = body[i]
        ex = r[executed] if executed is not None else "-"
        print(f"  {i:6d} {count(r[col[SAMPLES]]):6d} {ex:>9s}  {r[1].strip()[:58]:58s} {top_reasons(r)}")

    print(f"regions of {args.bucket} instructions holding >= {args.min_share}% of the samples:")
    for b0 in range(0, len(body), args.bucket):
        part = body[b0:b0 + args.bucket]
        s = sum(count(r[col[SAMPLES]]) for r in part)
        if 100 * s / n < args.min_share:
            continue
        c = collections.Counter()
        for r in part:
            for h in reasons:
                c[h] += count(r[col[h]])
        print(f"  {b0:6d}-{b0 + len(part) - 1:<6d} {s:7d} {100 * s / n:5.1f}%  "
              + " ".join(f"{h[6:]}={v}" for h, v in c.most_common(4)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
