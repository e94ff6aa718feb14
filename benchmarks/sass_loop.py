"""The chunk loop of a tensor-core kernel instance in SASS, by source line, without a GPU.

    bash benchmarks/sass_offline.sh bfloat16 64 64 Forward   # writes /tmp/sass_<tag>.txt and runs this
    bash benchmarks/sass_offline.sh wgmma bfloat16 2 2 Forward   # a wgmma_product_kernel instance
    python benchmarks/sass_loop.py SASS.txt SOURCE.cuh [--kernel NAME]

The loop is the backward branch whose range holds the most HMMA (or HGMMA) instructions; each
instruction is counted under the outermost line of the source file it was inlined into (nvdisasm
-gi's chains), so that a line's count is what that statement costs a chunk, and by opcode.
Static counts: the lines of branches a call does not take (normalize, bias, one-buffer staging,
a uniform branch's other side) count too.
"""
import argparse
import collections
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sass_summary import opcode  # noqa: E402  (one reading of a SASS line's opcode for both tools)


def parse(path, kernel="tensorcore_product_kernel"):
    text = open(path).read()
    m = re.search(r"\.text\.(_ZN16fast_causal_attn4cuda\d+" + kernel + r"\S*):\n(.*?)(?=\n//-----|\Z)", text, re.S)
    if m is None:
        sys.exit(f"no {kernel} in {path}")
    instructions, labels, pending, where = [], {}, [], ("?", 0)
    for line in m.group(2).split("\n"):
        label = re.match(r"\s*(\.L_x_\d+):", line)
        if label:
            pending.append(label.group(1))
            continue
        source = re.match(r'\s*//## File "([^"]+)", line (\d+)', line)
        if source:  # an inlining chain ends with its outermost line: the last one wins
            where = (source.group(1).split("/")[-1], int(source.group(2)))
            continue
        code = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if code:
            text_ = code.group(2).strip()
            address = int(code.group(1), 16)
            instructions.append((address, opcode(text_), text_, where))
            for name in pending:
                labels[name] = address
            pending = []
    return instructions, labels


def chunk_loop(instructions, labels, rank=0):
    """The loop (a backward branch's range) with the most HMMA or HGMMA, the longest of equals;
    rank N: the N-th after it (a kernel with a loop for each warpgroup: the one-pass backward's dq)."""
    loops = set()
    for address, op, text_, _ in instructions:
        target = re.search(r"(\.L_x_\d+)", text_) if op.startswith("BRA") else None
        if target and labels.get(target.group(1), address) < address:
            start = labels[target.group(1)]
            hmma = sum(1 for x in instructions if start <= x[0] <= address and x[1] in ("HMMA", "HGMMA"))
            loops.add((hmma, address - start, start, address))
    hmma, _, start, end = sorted(loops, reverse=True)[rank]
    return [x for x in instructions if start <= x[0] <= end], hmma


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sass")
    parser.add_argument("source")
    parser.add_argument("--kernel", default="tensorcore_product_kernel")
    parser.add_argument("--rank", type=int, default=0, help="the loop with the N-th most HMMA (0: the most)")
    args = parser.parse_args()
    path, source = args.sass, args.source
    instructions, labels = parse(path, args.kernel)
    loop, hmma = chunk_loop(instructions, labels, args.rank)
    print(f"kernel {len(instructions)} instructions; chunk loop {len(loop)} (HMMA or HGMMA {hmma})")
    print("  by opcode:", dict(collections.Counter(x[1] for x in loop).most_common(16)))
    lines = open(source).read().split("\n")
    by_line = collections.defaultdict(collections.Counter)
    for x in loop:
        by_line[x[3]][x[1]] += 1
    for (name, number), ops in sorted(by_line.items(), key=lambda kv: -sum(kv[1].values())):
        count = sum(ops.values())
        if count >= 8:
            text_ = lines[number - 1].strip()[:60] if name == source.split("/")[-1] else ""
            print(f"{count:5d} {name}:{number} {text_}  {dict(ops.most_common(5))}")


if __name__ == "__main__":
    main()
