#!/usr/bin/env bash
# How the SMs' reads reach the L2, per kernel: ncu's raw counters for the global-to-shared copies
# (cp.async, LDGSTS) and the L2 read requests they become. A 16-byte copy that reaches the L2 as
# its own one-sector request shows as about 1 sector a request (the unswizzled wgmma staging did:
# 5.9 M requests for 5.9 M sectors, fla 0.79 M for 3.1 M; RESULTS.md, seventeenth session).
#
#   bash benchmarks/l2_requests.sh wgmma python benchmarks/profile_kernels.py 8 16 2048 64 64 fwd bfloat16
#   bash benchmarks/l2_requests.sh tensorcore_product python benchmarks/profile_kernels.py 8 16 2048 64 64 fwd float32
#
# The first argument is a regex of kernel names; the rest is the command that launches them.
set -euo pipefail
pattern=$1
shift
metrics=gpu__time_duration.sum,smsp__inst_executed_op_ldgsts.sum,l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum
metrics+=,lts__t_requests_srcunit_tex_op_read.sum,lts__t_sectors_srcunit_tex_op_read.sum,dram__bytes_read.sum
ncu --clock-control none -k "regex:$pattern" --metrics "$metrics" --csv --print-units base "$@" 2>/dev/null |
  python3 -c "$(cat <<'PY'
import csv, sys
rows = list(csv.reader(line for line in sys.stdin if line.startswith('"')))
header, data = rows[0], rows[1:]
at = {name: header.index(name) for name in ("ID", "Kernel Name", "Metric Name", "Metric Value")}
kernels = {}
for r in data:
    value = float(r[at["Metric Value"]].replace(",", ""))
    kernels.setdefault((r[at["ID"]], r[at["Kernel Name"]]), {})[r[at["Metric Name"]]] = value
for (_, name), m in kernels.items():
    requests, sectors = m["lts__t_requests_srcunit_tex_op_read.sum"], m["lts__t_sectors_srcunit_tex_op_read.sum"]
    us, copies = m["gpu__time_duration.sum"] / 1e3, m["smsp__inst_executed_op_ldgsts.sum"]
    l1, dram = m["l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum"], m["dram__bytes_read.sum"] / 1e6
    print(f"{name[:100]}\n    {us:8.1f} us  LDGSTS {copies:,.0f}  L1 global sectors {l1:,.0f}  L2 read requests "
          f"{requests:,.0f}  sectors {sectors:,.0f} ({sectors / max(requests, 1):.2f} a request)  DRAM read {dram:.1f} MB")
PY
)"
