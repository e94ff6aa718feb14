#!/usr/bin/env bash
# One device call: the issue's table beside the peers (fla and fast-transformers from third_party/),
# bfloat16 with --accuracy first, then float32, inside LIMIT seconds, with its logs written straight
# into $OUT as they grow (a call cut by its limit still brings back what ran).
#
#   LIMIT=540 bash benchmarks/issue_table.sh                 # both dtypes, every shape of the list
#   LIMIT=300 TABLE_DTYPES=bfloat16 bash benchmarks/issue_table.sh
#
# Why this shape (RESULTS.md, seventieth and seventy-first sessions):
# - A call's real limit is the device budget left after its start, not its timeout: LIMIT is what
#   the script keeps to, each stage under `timeout` of the seconds left.
# - At most 8 files come back from $OUT: this writes each dtype's bench.log and warm_peers.log
#   and the Triton cache's parts in cache/ (the benchmark's JSON and plot are removed; the rest
#   goes to the call's output). Bring the parts back into third_party/ as triton_cache.tar.gz.part00, part01, ...:
#   gpu_check.sh unpacks them, and fla's kernels then need no compiling (cold, a warm-up
#   compiled and autotuned one case in 230 s on an H100; the bench after it timed six shapes of
#   bf16 in the 255 s left).
# - The build is skipped where the package already imports (a warm machine that built it).
#
# Peers: third_party/fla (flash-linear-attention's fla/ at bc3b101), third_party/einops (einops'
# einops/), third_party/fast_transformers/causal_product_{cpu.cpp,cuda.cu}; `git archive` of each
# repository's commit (never committed here), e.g. from a clone or mirror of each:
#   git --git-dir=FLA/.git archive bc3b101 fla | tar x -C third_party
#   git --git-dir=EINOPS/.git archive HEAD einops | tar x -C third_party
#   git --git-dir=FT/.git archive 2ad36b9 fast_transformers/causal_product | tar x -C /tmp &&
#     mkdir -p third_party/fast_transformers && cp /tmp/fast_transformers/causal_product/*.c* third_party/fast_transformers/
# Carry third_party/fla, third_party/einops, third_party/fast_transformers and the cache parts.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/fast_causal_attn_out}
mkdir -p "$OUT"
LIMIT=${LIMIT:-540}
start=$(date +%s)
left() { echo $(( LIMIT - ($(date +%s) - start) )); }
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem --format=csv,noheader
if ! python -c "import fast_causal_attn._C" 2>/dev/null; then
  echo "== build ($(left) s left)"
  OUT=/tmp/issue_table_build STAGES="build" timeout $(( $(left) - 5 )) bash benchmarks/gpu_check.sh 2>&1 | tail -5
fi
for dtype in ${TABLE_DTYPES:-bfloat16 float32}; do
  (( $(left) > 60 )) || { echo "== $dtype: not run ($(left) s left)"; continue; }
  echo "== $dtype ($(left) s left)"
  accuracy=$([[ $dtype != float32 ]] && echo "--accuracy")  # (float32's float64 reference: minutes)
  # (no warm-up of its own by default: the bench compiles each peer's kernels at its first call,
  # before timing it; a warm-up in the same call only moves that time ahead)
  OUT="$OUT/$dtype" STAGES="bench" WARM_LIMIT=${WARM_LIMIT:-1} \
    BENCH_ARGS="--dtypes $dtype --kernel-time $accuracy ${TABLE_ARGS:-}" \
    timeout $(( $(left) - 5 )) bash benchmarks/gpu_check.sh >/dev/null 2>&1
  echo "exit $? (124: the limit)"
  rm -f "$OUT/$dtype"/cuda.json "$OUT/$dtype"/cuda.png
  # the cache once, the latest (it holds every dtype's kernels so far)
  if compgen -G "$OUT/$dtype/triton_cache.tar.gz.part*" >/dev/null; then
    rm -rf "$OUT/cache" && mkdir -p "$OUT/cache" && mv "$OUT/$dtype"/triton_cache.tar.gz.part* "$OUT/cache/"
  fi
  echo "warm-up: $(grep -c '^warmed' "$OUT/$dtype/warm_peers.log" 2>/dev/null) cases compiled"
  grep -E "^$dtype|GPU busy|relative error|bandwidth" "$OUT/$dtype/bench.log" 2>/dev/null | cut -c1-150
done
