"""Where a kernel's instructions and stalls go, from ncu's SASS source page, in a few lines.

    ncu -i REPORT.ncu-rep --page source --csv --print-source sass > sass.csv
    python benchmarks/sass_summary.py sass.csv [--top 25]

The whole page (every SASS line of every profiled launch) is tens of MB, more than a device call
brings back; this prints, for each launch in it, the executed instructions by opcode (their share
of the launch's total), the shared-memory wavefronts by opcode where the page has them, and the
source lines with the most stall samples, each with the line before it: a sample falls on the
instruction that waits to issue, so a wait (BAR.SYNC, DEPBAR, WARPGROUP.DEPBAR, a try_wait's
branch) shows as the line after it (forty-first session: a UMOV behind the consumers' kFull
BAR.SYNC held 13.7% of the float32 pass's samples). --columns lists the page's metrics.
"""
import argparse
import collections
import csv
import re


def number(cell):
    try:
        return float(cell.replace(",", ""))
    except ValueError:
        return 0.0


def column(header, *words, avoid=()):
    """Index of the first column whose name holds every word (case-insensitive) and none of avoid."""
    for i, name in enumerate(header):
        low = name.lower()
        if all(w in low for w in words) and not any(a in low for a in avoid):
            return i
    return None


def sections(rows):
    """(label, header, rows) for each launch: a header row (one naming a Source column) starts one;
    the last other line before it, if any, names it."""
    label, pending, header, body = "", "", None, []
    for row in rows:
        if any(cell.strip() == "Source" for cell in row):
            if header is not None:
                yield label, header, body
            label, header, body = pending, row, []
        elif header is not None and len(row) == len(header):
            body.append(row)
        else:  # a line outside the table names the next launch
            pending = " ".join(cell for cell in row if cell).strip() or pending
    if header is not None:
        yield label, header, body


def opcode(source):
    """HMMA.16816.F32.BF16 R4, ... -> HMMA; a guard (@P0, @!PT) is dropped."""
    words = source.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return re.split(r"[.\s]", words[0])[0] if words else "?"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("csv")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--columns", action="store_true", help="also list each table's column names")
    args = parser.parse_args()
    with open(args.csv, newline="", errors="replace") as f:
        rows = list(csv.reader(f))
    found = False
    for n, (label, header, body) in enumerate(sections(rows)):
        src = column(header, "source")
        executed = column(header, "instructions executed", avoid=("thread", "predicated"))
        stalls = column(header, "warp stall sampling (all")
        # (ncu's "L1 Wavefronts Shared"; not its Ideal or Excessive columns)
        shared = column(header, "wavefronts shared", avoid=("ideal", "excessive"))
        if src is None or executed is None:
            continue
        found = True
        by_opcode = collections.Counter()
        stall_by_opcode = collections.Counter()
        shared_by_opcode = collections.Counter()
        lines = []
        previous = ""
        for row in body:
            count = number(row[executed])
            stall = number(row[stalls]) if stalls is not None else 0.0
            op = opcode(row[src])
            by_opcode[op] += count
            stall_by_opcode[op] += stall
            if shared is not None:
                shared_by_opcode[op] += number(row[shared])
            lines.append((stall, count, row[src].strip(), previous))
            previous = row[src].strip()
        total = sum(by_opcode.values()) or 1.0
        total_stall = sum(stall_by_opcode.values()) or 1.0
        print(f"== launch {n}: {label[:160]}")
        print(f"   {total:,.0f} warp instructions executed, {total_stall:,.0f} stall samples")
        print("   opcode        executed  share   stall share")
        for op, count in by_opcode.most_common(args.top):
            print(f"   {op:12} {count:11,.0f}  {count / total:5.1%}   {stall_by_opcode[op] / total_stall:5.1%}")
        total_shared = sum(shared_by_opcode.values())
        if total_shared > 0:
            print(f"   shared-memory wavefronts: {total_shared:,.0f}; by opcode:")
            for op, count in shared_by_opcode.most_common(min(args.top, 12)):
                if count > 0:
                    print(f"   {op:12} {count:13,.0f}  {count / total_shared:5.1%}")
        print("   SASS lines with the most stall samples (samples, executed, line; the line before it):")
        for stall, count, text, before in sorted(lines, key=lambda x: (x[0], x[1]), reverse=True)[: args.top]:
            print(f"   {stall:8,.0f} {count:11,.0f}  {text[:70]:70}  after: {before[:60]}")
        if args.columns:
            print("   columns:", "; ".join(header))
    if not found:
        print(f"no SASS table with a Source and an Instructions Executed column in {args.csv}")


if __name__ == "__main__":
    main()
