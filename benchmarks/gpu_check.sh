#!/usr/bin/env bash
# One device call: build for sm_90a (the H200, with the wgmma kernel), run the GPU tests, the
# sanitizer subset and the benchmark.
#
#   bash benchmarks/gpu_check.sh                 # every stage
#   STAGES="build tests" bash benchmarks/gpu_check.sh
#   STAGES="build smoke tests" ...  # float32 fwd+bwd at 9 shapes under a watchdog first
#                               # (benchmarks/smoke_float32.py), the suite only if it passes
#   STAGES="build decode" ...   # the decoding-step benchmark
#   STAGES="build diag" ...     # toolchain, and which bad inputs crash instead of raising (backtrace)
#   STAGES="build tests bench" TESTS="tensorcore" BENCH_ARGS="--no-peers --families" ...
#                               # one kernel family's tests, then every family timed (no peers)
#   STAGES="build profile" PROFILE="8 16 2048 64 64 fwd bfloat16" ...  # ncu of the tensor-core kernels
#   STAGES="build bench" BENCH_ARGS="--no-peers --sweep FAST_CAUSAL_ATTN_SEGMENTS=1,2,3 --methods segments" ...
#                               # the default path at each value of a switch
#   STAGES="build host" ...     # where the host's time to issue a call goes (benchmarks/host_profile.py)
#                               # and whether it waits for the GPU (host_sync.py)
#   STAGES="build launches" LAUNCHES="1 16 32768 128 128 bwd bfloat16" ...
#                               # each launch's duration, DRAM bytes and tensor-pipe use (ncu), the default path
#   STAGES="build sanitize" SANITIZE_SUBSETS="forward_segments" SANITIZE_TOOLS=racecheck ...
#                               # one sanitizer on some of the subsets
#   STAGES="build tests sanitize" SANITIZE_BESIDE_TESTS=1 ...
#                               # the sanitizers beside the tests, not after them (a call's
#                               # minutes: the one_pass subset's three tools took 60-90 s, the
#                               # tests of a change 100-120 s on 12-16 workers; RESULTS.md,
#                               # sixty-third session). Wait on PIDs, never `pgrep -f gpu_check`:
#                               # that matches the device call's own shell
#   STAGES="build ab" BASELINE=third_party/base BENCH_ARGS="--no-peers --kernel-time ..." ...
#                               # the same benchmark on a baseline tree and on this one: first
#                               # `rm -rf third_party/base && mkdir third_party/base &&
#                               # git archive main | tar x -C third_party/base` here (git-ignored,
#                               # carried with third_party); it is built in place beside this tree.
#                               # AB_ORDER="base this base" (default "base this") runs the trees in
#                               # that order, a repeat's log numbered (bench_base2.log): the same
#                               # code's drift between runs beside the two trees' difference (the
#                               # forward alone moved up to 11% with its loop's SASS unchanged,
#                               # RESULTS.md, thirty-second session). Any other name in AB_ORDER
#                               # is the tree third_party/NAME (made as base is, then patched),
#                               # built beside the others: two variants against one base in a call
#   STAGES="wgmma" ...          # the wgmma forward prototype checked and timed (wgmma_forward.py);
#                               # WGMMA_PROBE=1 first reruns the layout probe (wgmma_probe.py)
#   STAGES="ring_race" ...      # racecheck of the stage ring's protocol alone (benchmarks/racecheck_probe.py;
#                               # needs no build of the extension)
#   STAGES="rate" ...           # wgmma's multiply-adds a cycle by N, A's source and shared-memory
#                               # stores beside it (benchmarks/wgmma_rate.py; needs no build)
#   STAGES="build anatomy" ...  # fla's fused_chunk forward beside our one segment and the wgmma
#                               # prototype (benchmarks/fla_anatomy.py), then ncu of the three:
#                               # durations, instructions, stalls by opcode (ANATOMY="B H L D")
#
# Logs and benchmark results go to $OUT (the device tool brings that folder back). The tests stage
# runs the CUDA tests and every error test (the error paths once crashed only on that machine).
set -u -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/fast_causal_attn_out}
mkdir -p "$OUT"
STAGES=${STAGES:-"build smoke tests sanitize bench"}
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0a} MAX_JOBS=${MAX_JOBS:-16} PYTHONUNBUFFERED=1
# a 9.0a build holds the wgmma kernel: its test then checks that the default path takes it
[[ "$TORCH_CUDA_ARCH_LIST" == *9.0a* ]] && export FAST_CAUSAL_ATTN_EXPECT_WGMMA=1
status=0
has() { [[ " $STAGES " == *" $1 "* ]]; }
# The sanitizer logs (sanitize_NAME_TOOL.log and .rc, about 120 in a whole run) as one file when
# the script ends, under `timeout` too: a device call brings back at most 8 files (the logs were
# lost so, RESULTS.md, seventy-fourth session). timeout sends TERM to the script's process group;
# the TERM trap exits, which runs the EXIT trap.
pack_sanitize_logs() {
  (cd "$OUT" && shopt -s nullglob && logs=(sanitize_*_*.log sanitize_*.rc) && (( ${#logs[@]} > 0 )) &&
    tar czf sanitize_logs.tgz "${logs[@]}" && rm -f "${logs[@]}" && echo "sanitizer logs: \$OUT/sanitize_logs.tgz")
}
trap pack_sanitize_logs EXIT
trap 'exit 143' TERM
# the tests' and sanitizers' outcomes, printed again at the end (a later invocation in the same
# call that runs neither prints this one's)
if has tests || has sanitize; then : >"$OUT/summary.txt"; fi

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"

# an A/B tree's folder: base is $BASELINE, this is this tree (its editable install), any other
# name third_party/NAME
ab_tree() { case $1 in this) echo "";; base) echo "${BASELINE:-}";; *) echo "third_party/$1";; esac; }
declare -A ab_pids=()
if has ab; then  # the other trees build beside this tree's build (the jobs shared out)
  others=$(for tree in ${AB_ORDER:-base this}; do [[ $tree == this ]] || echo "$tree"; done | sort -u)
  jobs=$(( MAX_JOBS / ($(echo "$others" | wc -w) + 1) ))
  for tree in $others; do
    dir=$(ab_tree "$tree")
    [[ -f "$dir/setup.py" ]] || { echo "ab: $tree's tree ${dir:-(BASELINE unset)} holds no setup.py"; exit 1; }
    (cd "$dir" && MAX_JOBS=$(( jobs > 1 ? jobs : 1 )) python setup.py build_ext --inplace >"$OUT/${tree}_build.log" 2>&1) &
    ab_pids[$tree]=$!
  done
fi
if has build; then
  start=$(date +%s)
  if ! python -m pip install -v --no-deps --no-build-isolation --no-index -e . >"$OUT/build.log" 2>&1; then
    grep -E "error|Error" "$OUT/build.log" | head -40
    tail -20 "$OUT/build.log"
    exit 1
  fi
  echo "build: $(( $(date +%s) - start )) s"
  grep -h -A2 "Compiling entry" build/*/*.log 2>/dev/null | grep -E "spill" | sort | uniq -c | head -5
  # ptxas serializing a kernel's wgmma (an accumulator read while its products run) costs 2x
  grep -h -E "C7514|C7510" build/*/*.log "$OUT/build.log" 2>/dev/null | sed -E "s/ in the function.*//" | sort | uniq -c | head -5
fi

# fla's Triton kernels compile on first use, minutes for the whole list (one call's limit, beside
# the tests). The compiled kernels come back as $OUT/triton_cache.tar.gz.part00, part01, ... (a
# file that comes back holds at most 16 MiB; bf16 and fp32 together were 24 MB); saved as
# third_party/triton_cache.tar.gz.part* (git-ignored, carried with third_party) they are unpacked
# here and the next call finds them compiled (as does one whole third_party/triton_cache.tar.gz).
export TRITON_CACHE_DIR=/tmp/triton_cache TRITON_CACHE_AUTOTUNING=1
mkdir -p "$TRITON_CACHE_DIR"
if compgen -G "third_party/triton_cache.tar.gz.part*" >/dev/null; then
  cat third_party/triton_cache.tar.gz.part* | tar xzf - -C "$TRITON_CACHE_DIR"
elif [[ -f third_party/triton_cache.tar.gz ]]; then
  tar xzf third_party/triton_cache.tar.gz -C "$TRITON_CACHE_DIR"
fi
save_triton_cache() {
  rm -f "$OUT"/triton_cache.tar.gz.part*
  tar czf - -C "$TRITON_CACHE_DIR" . | split -b 15m -d - "$OUT/triton_cache.tar.gz.part" &&
    echo "triton cache: $(cat "$OUT"/triton_cache.tar.gz.part* | wc -c) bytes in \$OUT/triton_cache.tar.gz.part*"
}
# Compile the peers' kernels beside the tests (same cases and methods as the bench stage), so that
# the bench stage finds them cached.
# WARM_ARGS="--dtypes bfloat16 --shapes ..." warms those cases in any call (beside the tests of an
# ab call, say); it is waited for before any timing stage.
warm_pid=""
warm_args=""
if [[ -n "${WARM_ARGS:-}" ]]; then
  warm_args=$WARM_ARGS
elif has bench && [[ " ${BENCH_ARGS:-} " != *" --no-peers "* ]]; then
  warm_args="${BENCH_ARGS:-} "
fi
if [[ -n "$warm_args" ]]; then
  # at most WARM_LIMIT seconds (what compiled by then stays in the cache)
  timeout "${WARM_LIMIT:-300}" python benchmarks/benchmark.py --warm-peers $warm_args >"$OUT/warm_peers.log" 2>&1 &
  warm_pid=$!
fi
finish_warm() {  # before timing: the warm-up's compiles and autotuning would share the machine
  [[ -n "$warm_pid" ]] || return 0
  wait "$warm_pid"
  echo "warm-up: $(grep -c '^warmed' "$OUT/warm_peers.log") cases warmed"
  save_triton_cache
  warm_pid=""
}

if has diag; then  # the toolchain and a native backtrace of any crashing error path
  g++ --version | head -1; nvcc --version | tail -1; python -c "import sys; print('python', sys.version.split()[0])"
  so=$(python -c "import fast_causal_attn._C as m; print(m.__file__)")
  ldd "$so" | grep -E "stdc\+\+|libgcc|libc10|libtorch" | sed 's/^/  /'
  python benchmarks/error_probe.py 2>&1 | tee "$OUT/error_probe.log"
  first=$(grep -m1 -E "exit +-" "$OUT/error_probe.log" | sed -E 's/^\[([0-9]+)\].*/\1/')
  debugger=$(command -v cuda-gdb || command -v gdb || true)
  if [[ -n "$first" && -n "$debugger" ]]; then
    "$debugger" -batch -ex run -ex bt --args python benchmarks/error_probe.py --case "$first" >"$OUT/crash_bt.log" 2>&1
    grep -E "^#" "$OUT/crash_bt.log" | head -30
  fi
fi

if has smoke; then  # float32's kernels at a few shapes under a watchdog: a deadlock fails here, in seconds
  timeout "${SMOKE_TIMEOUT:-150}" python benchmarks/smoke_float32.py 2>&1 | tee "$OUT/smoke.log" | tail -12
  smoke_rc=${PIPESTATUS[0]}
  (( smoke_rc == 0 )) || { echo "smoke: failed (exit $smoke_rc; 124: the watchdog)"; exit 1; }
fi

# The sanitizer subsets (the sanitize stage), a function so that SANITIZE_BESIDE_TESTS=1 may run it
# beside the tests stage (its own processes on the one GPU; its output printed once both end)
sanitize_stage() {
  # sanitize NAME PYTEST_K [FILE]: memcheck, racecheck and synccheck (the producer warpgroups'
  # named barriers) of the tests FILE's -k selects (tests/test_correctness.py by default);
  # SANITIZE_TOOLS picks some of them; SANITIZE_SUBSETS="forward_segments ..." runs only the
  # subsets named (default: all)
  # SANITIZE_JOBS=N runs up to N of them at once (each its own process on the one GPU; default 1)
  sanitize_one() {  # NAME PYTEST_K FILE TOOL: its log, and its exit status in a file beside it
    compute-sanitizer --tool $4 --error-exitcode 9 python -m pytest "$3" -q -k "$2" \
      -p no:cacheprovider >"$OUT/sanitize_$1_$4.log" 2>&1
    echo $? >"$OUT/sanitize_$1_$4.rc"
  }
  sanitize() {  # NAME PYTEST_K [FILE] [TOOLS_NOT_RUN]
    [[ -n "${SANITIZE_SUBSETS:-}" && " $SANITIZE_SUBSETS " != *" $1 "* ]] && return 0
    for tool in ${SANITIZE_TOOLS:-memcheck racecheck synccheck}; do
      [[ " ${4:-} " == *" $tool "* ]] && continue
      while (( $(sanitize_running) >= ${SANITIZE_JOBS:-1} )); do sleep 1; done
      sanitize_one "$1" "$2" "${3:-tests/test_correctness.py}" $tool &
      sanitize_pids+=($!)
    done
  }
  sanitize_pids=()
  rm -f "$OUT"/sanitize_*.rc
  sanitize_running() {  # (the warm-up and a baseline's build are this shell's jobs too: not counted)
    local n=0 pid
    for pid in "${sanitize_pids[@]}"; do kill -0 "$pid" 2>/dev/null && n=$(( n + 1 )); done
    echo $n
  }
  sanitize_report() {  # once every run has ended: each one's status, reports and pytest summary
    for pid in "${sanitize_pids[@]}"; do wait "$pid"; done
    for rc_file in "$OUT"/sanitize_*.rc; do
      [[ -f "$rc_file" ]] || continue
      log=${rc_file%.rc}.log
      rc=$(cat "$rc_file")
      {
        echo "compute-sanitizer $(basename "${rc_file%.rc}" | sed 's/^sanitize_//'): rc=$rc, $(grep -c -E '^=========.*(Invalid|Race|Error)' "$log") reports; $(grep -E "passed|failed|error|no tests ran" "$log" | tail -1)"
        # a failing run's pytest summary (a failed assertion, no test selected) beside the reports
        [[ "$rc" != 0 ]] && grep -E "^(E |FAILED|ERROR)|no tests ran|deselected" "$log" | head -12
      } | tee -a "$OUT/summary.txt"
      status=$(( status | rc ))
    done
  }
  # bfloat16's two-part state copy at DA = 128 (one chunk buffer, two blocks a multiprocessor)
  sanitize bf16_parts "test_bfloat16_holds_the_issue_accuracy and B1H2L2048E128M128"
  # the wgmma kernels (the default's on 9.0a builds): partial chunks, rows at any alignment (that
  # test is normalized: bfloat16's in wgmma_rows_normalize, float32's here, which racecheck passes)
  sanitize wgmma "cuda and not cuda- and (test_matches_reference and B2H3L65E16M16 and plain and (float16 or bfloat16) or test_rows_at_any_alignment and float32)"
  # 16-bit rows at any alignment, normalized: not under racecheck (its 7 reports on the H100,
  # seventy-fourth session, were the producer's staged writes, divide_rows and RowTerms::put,
  # against the consumers' reads: the named-barrier pattern of wgmma_normalize below)
  sanitize wgmma_rows_normalize "cuda and not cuda- and test_rows_at_any_alignment and bfloat16" tests/test_correctness.py racecheck
  # the one-launch segments at E, M up to 64 (KernelParams::lookback: the forward, dk with dv)
  sanitize one_launch "test_16_bit_plain and B2H3L333E40M24 and blhd and (3-wgmma or 8-wgmma)" tests/test_wgmma.py
  # the normalized forward and dk with dv in one launch (the key sums, the extra row's sums published
  # beside the state's), from a given start; not under racecheck (the normalized kernels'
  # named-barrier pattern: wgmma_normalize)
  sanitize one_launch_normalize "(test_normalized_forward_in_one_launch or test_normalized_grad_kv_in_one_launch) and 3-given and bfloat16" tests/test_wgmma.py racecheck
  # states in and out on the wgmma kernels (a start into every segment, the end from the last)
  sanitize wgmma_states "test_states_on_the_wgmma_kernels and B2H3L300E64M64 and bhld" tests/test_wgmma.py
  # the one-pass backward (wgmma_grad_kv_kernel's kWithDq: two consumer warpgroups of different
  # code on one ring, their barriers not .aligned): a partial chunk, E != M, one chunk alone, in
  # segments (one launch's look-back and summing walk, the dq warpgroup idle through it), and in
  # three launches (its state-only blocks), and in 9 segments of two of the forward's 18 each (one_pass_span)
  sanitize one_pass "test_one_pass_backward and not states and not kept and bhld and (spanning and plain or one-pass and (B2H3L333E40M24 or B1H1L64E64M64 or B2H2L4100E64M64 and three))" tests/test_wgmma.py
  # the same under normalize (dq's extra row, its key sum in shared memory, its barrier kSummed's;
  # the sequence's first chunk in the forward's form): one chunk, one segment, three launches,
  # spanning. Not under racecheck: the producer's q / den against the consumer's reads of it is
  # the named-barrier pattern the tool does not follow (wgmma_normalize below; RESULTS.md,
  # fifty-third and sixty-fourth sessions)
  sanitize one_pass_normalize "test_normalized_one_pass_backward and bhld and (B2H3L333E40M24-bhld-3 or B1H1L64E64M64-bhld-1) or test_one_pass_backward_spanning and bhld and normalized" tests/test_wgmma.py racecheck
  # the normalized 16-bit kernels (KeySums, the extra rows): one atom on one warpgroup, two atoms on
  # two (outputs staged over the copy), four split between two (their row sums exchanged), segments,
  # dk and dv as two reverse passes (q / den divided by the producer);
  # and one atom in one segment of 5 chunks (3 stage slots: the consumers' ordinary loads of a
  # staged tile before the producer refills its slot).
  # Not under racecheck: it reports the stage ring's order itself (consumers' reads, bar.arrive;
  # producer's bar.sync, writes) as a race wherever a consumer reads a staged tile with ordinary
  # loads, as it does on benchmarks/racecheck_probe.cu, that protocol alone with correct sums
  # (gpu_check's ring_race stage; RESULTS.md, fifty-third session)
  # (and the 16-bit reverse passes' normalized cases of wgmma_256, whose racecheck reported the
  # same pattern: divide_rows and copy_16 against the consumers' reads, seventy-fourth session)
  sanitize wgmma_normalize "test_normalized_forward_on_the_wgmma_kernels and (B2H3L300E64M64 or B1H2L700E128M96 or B1H1L260E160M200) and bhld and 3-0.7-given or test_normalized_two_reverse_passes_with_states and B1H2L333E128M40 and 3- or test_16_bit_two_reverse_passes and B2H3L333E40M24 and 3- and normalized" tests/test_wgmma.py racecheck
  # float32's normalized forward (KeySum: z handed on with S, Z16 beside A S; at E = 256 in two
  # row tiles, den's parts added), dq and dk (their extra row; at M = 200 in row tiles, the extra
  # row in tile 0's) and dv (RowTerms), 64 rows a block and 128, in segments, from a given state;
  # the backward's own segments
  sanitize wgmma_tf32_normalize "test_float32_normalized_forward_on_the_wgmma_kernels and (B2H3L300E64M64 or B1H2L700E128M96 or B1H2L300E256M64) and bhld and 3-0.7-given or test_float32_normalized_backward_segments and (B2H3L300E64M64 or B1H2L333E40M200)" tests/test_wgmma.py
  sanitize wgmma_normalize_reuse "test_normalized_forward_on_the_wgmma_kernels and B2H3L300E64M64 and bhld and 1-0.7-given and bfloat16" tests/test_wgmma.py racecheck
  # the wgmma kernels at E, M above 64 (two atoms, two warpgroups; dk and dv on the wide kernel)
  sanitize wgmma_wide "test_16_bit_plain and (B1H3L200E24M128 or B2H1L150E96M40) and blhd and (1-wgmma or 3-wgmma)" tests/test_wgmma.py
  # two warpgroups on their own column halves sharing A and B (E = M = 128: two atoms each)
  sanitize wgmma_two_groups "test_16_bit_plain and B1H2L300E128M128 and blhd and (1-wgmma or 3-wgmma)" tests/test_wgmma.py
  # the 16-bit wgmma kernels above 128: four atoms, two stage slots, dk and dv as reverse passes
  # (their normalized cases in wgmma_normalize)
  sanitize wgmma_256 "(test_16_bit_head_dims_above_128 and (B1H1L100E136M200 or B2H1L130E256M40) and blhd and (1-wgmma or 3-wgmma)) or (test_16_bit_two_reverse_passes and B2H3L333E40M24 and 3- and plain)" tests/test_wgmma.py
  # the 16-bit plain passes above 128 in one segment on wgmma_transposed_kernel (the state in
  # registers; bulk tensor copies in and out, mbarriers): partial chunks and atoms, E != M, both layouts
  sanitize transposed "test_16_bit_head_dims_above_128 and 1-wgmma" tests/test_wgmma.py
  # float32's wgmma forward and dq (3xTF32): segments, partial chunks, rows at any alignment
  sanitize wgmma_tf32 "test_float32_plain and (B2H3L333E40M24 or B2H1L130E200M136) and blhd and (1-wgmma or 3-wgmma) or test_float32_unaligned_rows and not sync" tests/test_wgmma.py
  # float32's row tiles one launch each (tile 0 stores, the later ones add)
  sanitize row_tile_launches "test_float32_row_tiles_one_launch_each and B2H1L130E200M136 and blhd" tests/test_wgmma.py
  # the default path at a few shapes; bfloat16's normalized cases not under racecheck (their 44
  # reports on the H100, seventy-fifth session, were RowTerms::put's staged writes against
  # dq_rows' reads: the named-barrier pattern of wgmma_normalize above)
  default_cases="test_matches_reference and cuda and (B2H3L65E16M16 or B1H1L65E257M1 or B2H2L65E3M17)"
  sanitize default "$default_cases and (float32 or bfloat16 and plain)"
  sanitize default_normalize "$default_cases and bfloat16 and normalized" tests/test_correctness.py racecheck
  # the chunk pipelines the default does not take (one buffer in 16 bits, two in float32)
  sanitize buffers "test_tensor_core_chunk_buffers and B2H3L300E64M64"
  # the fused recurrent dk/dv pass (tiles of 16 timesteps, partial rows and columns)
  sanitize fused_recurrent "test_recurrent_fused_grad_kv and bhld and (B2H3L100E128M128 or B1H2L333E100M70)"
  # the state-only launch in heads and tails (tails' own regions, added by the scan; empty tails)
  sanitize state_heads "test_tensor_core_state_heads_and_tails and B2H1L700E128M40 and normalized and (float32 or bfloat16)"
  # the dq pass starting from the forward's segment starts (read transposed)
  sanitize forward_segments "test_grad_q_from_forward_segments and B1H2L1100E32M48 and float32"
  sanitize_report
  return $status
}

sanitize_beside_pid=""
if has sanitize && has tests && [[ "${SANITIZE_BESIDE_TESTS:-0}" == 1 ]]; then
  sanitize_stage >"$OUT/sanitize_stage.log" 2>&1 &
  sanitize_beside_pid=$!
fi

if has tests; then
  python -m pytest tests -q -rs -k "${TESTS:-cuda or test_errors or wgmma}" --maxfail=30 --durations=20 -p no:cacheprovider ${PYTEST_ARGS:-} 2>&1 |
    tee "$OUT/pytest_cuda.log" | tail -40
  status=$(( status | $? ))
  echo "tests: $(tail -1 "$OUT/pytest_cuda.log")" >>"$OUT/summary.txt"
fi

if has sanitize; then
  if [[ -n "$sanitize_beside_pid" ]]; then
    wait "$sanitize_beside_pid"
    status=$(( status | $? ))
    cat "$OUT/sanitize_stage.log"
  else
    sanitize_stage
    status=$(( status | $? ))
  fi
fi

if has profile; then  # where a kernel's time goes: PROFILE="B H L E M fwd|bwd dtype", PROFILE_KERNEL (a regex)
  args=${PROFILE:-"8 16 2048 64 64 fwd bfloat16"}
  kernel=${PROFILE_KERNEL:-tensorcore_product_kernel}
  family=$([[ "$kernel" == tensorcore* ]] && echo tensorcore)  # the mma.sync kernels forced; else the default path
  name=tc_$(echo "$args" | tr ' ' '_')
  FAST_CAUSAL_ATTN_KERNEL=$family ncu --clock-control none -k regex:"$kernel" --set full \
    --import-source yes -f -o "/tmp/$name" python benchmarks/profile_kernels.py $args >"$OUT/ncu_run.log" 2>&1
  # the report stays on the machine (too large to bring back): its pages are read here
  ncu -i "/tmp/$name.ncu-rep" --page details >"$OUT/$name.txt" 2>&1
  # the SASS page is tens of MB (more than a call brings back): kept on the machine, summarized
  ncu -i "/tmp/$name.ncu-rep" --page source --csv --print-source sass >"/tmp/${name}_sass.csv" 2>&1
  python benchmarks/sass_summary.py "/tmp/${name}_sass.csv" >"$OUT/${name}_sass_summary.txt" 2>&1
  head -60 "$OUT/${name}_sass_summary.txt"
  grep -E "$kernel|Duration|Compute \(SM\) Throughput|Memory Throughput|Registers Per|Achieved Occupancy|Grid Size|Warp Cycles Per Issued" \
    "$OUT/$name.txt" | head -40
  for segments in "" 1 2; do  # the same launches by segment count (default, 1, 2), durations only
    echo "FAST_CAUSAL_ATTN_SEGMENTS=${segments:-default}:"
    FAST_CAUSAL_ATTN_SEGMENTS=$segments FAST_CAUSAL_ATTN_KERNEL=$family ncu --clock-control none \
      -k regex:"$kernel|scan_segments" --section SpeedOfLight python benchmarks/profile_kernels.py $args 2>&1 |
      grep -E "Duration|Grid Size|$kernel|scan_segments" | sed -E 's/\(fast_causal_attn::cuda::KernelParams.*//'
  done
fi

if has launches; then  # each launch's duration, DRAM traffic and tensor-pipe use on the default
  # path, by ncu (one kernel's instances, the state-only launch and the pass say, are one name in
  # the profiler's table): LAUNCHES="B H L E M fwd|bwd dtype;..." (the bf16 tensor path's ops as a
  # percentage of a peak that counts sparsity's 2x, it seems: half the dense use counted from the
  # products and durations, RESULTS.md, twenty-eighth session; sm__pipe_tensor_op_gmma_cycles_active
  # read n/a on the H200)
  IFS=';' read -ra launch_cases <<<"${LAUNCHES:-1 16 32768 128 128 bwd bfloat16;4 16 8192 64 64 bwd bfloat16}"
  for case_ in "${launch_cases[@]}"; do
    echo "== launches: $case_"
    ncu --clock-control none --metrics gpu__time_duration.sum,dram__bytes.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,launch__grid_size,sm__warps_active.avg.pct_of_peak_sustained_active,sm__ops_path_tensor_src_bf16_dst_fp32.sum.pct_of_peak_sustained_elapsed \
      python benchmarks/profile_kernels.py $case_ 2>&1 | tee "$OUT/launches_$(echo "$case_" | tr ' ' '_').log" |
      grep -E "^  [a-z_:]+.*\(|gpu__time|dram__bytes|dram__through|grid_size|warps_active|tensor_src" |
      sed -E 's/\(fast_causal_attn::(cuda::)?KernelParams.*//; s/^ +//' | cut -c1-160
  done
fi

if has host; then  # the host's time to issue a call, by op and CUDA runtime call
  finish_warm
  python benchmarks/host_profile.py ${HOST_ARGS:-} 2>&1 | tee "$OUT/host_profile.log"
  # and whether any piece of a call waits for the GPU (HOST_SYNC_ARGS: host_sync.py's)
  (cd benchmarks && python host_sync.py ${HOST_SYNC_ARGS:-}) 2>&1 | tee "$OUT/host_sync.log"
fi

if has anatomy; then  # fla autotunes in the timing run first: under ncu its autotuning launches
  # would be the ones profiled
  shape=${ANATOMY:-"8 16 2048 64"}
  python benchmarks/fla_anatomy.py $shape 2>&1 | tee "$OUT/anatomy.log" | grep -v "^{"  # (fla's variants: the log)
  ncu --clock-control none -k regex:"fused_chunk_fwd|tensorcore_product|wgmma_forward" --launch-skip 4 \
    --launch-count 4 --set full --import-source yes -f -o /tmp/anatomy \
    python benchmarks/fla_anatomy.py $shape --launches 3 >"$OUT/anatomy_ncu.log" 2>&1
  ncu -i /tmp/anatomy.ncu-rep --page details >"$OUT/anatomy_details.txt" 2>&1
  grep -E "fused_chunk_fwd|tensorcore_product_kernel|wgmma_forward_kernel|Duration|Executed Ipc A|Warp Cycles Per Issued|Executed Instructions  |Registers Per|Memory Throughput  " \
    "$OUT/anatomy_details.txt" | head -48
  ncu -i /tmp/anatomy.ncu-rep --page source --csv --print-source sass >/tmp/anatomy_sass.csv 2>&1
  python benchmarks/sass_summary.py /tmp/anatomy_sass.csv --top 20 >"$OUT/anatomy_sass_summary.txt" 2>&1
  head -c 6000 "$OUT/anatomy_sass_summary.txt"
fi

if has wgmma; then  # the wgmma (sm_90a) forward prototype checked and timed; WGMMA_PROBE=1 first
  # reruns the layout probe (settled on the H200 in the eighth session: the PTX ISA's order)
  [[ "${WGMMA_PROBE:-0}" == 1 ]] && python benchmarks/wgmma_probe.py 2>&1 | tee "$OUT/wgmma_probe.log"
  python benchmarks/wgmma_forward.py ${WGMMA_ARGS:-} 2>&1 | tee "$OUT/wgmma_forward.log"
fi

if has rate; then  # the wgmma ceiling the chunk kernels' m64n64k16 products meet
  python benchmarks/wgmma_rate.py ${RATE_ARGS:-} 2>&1 | tee "$OUT/wgmma_rate.log"
fi

if has ring_race; then  # whether racecheck reports the stage ring's protocol itself (benchmarks/racecheck_probe.py)
  python benchmarks/racecheck_probe.py 2>&1 | tail -6  # built (and its sums checked) outside the sanitizer first
  compute-sanitizer --tool racecheck python benchmarks/racecheck_probe.py >"$OUT/ring_race.log" 2>&1
  grep -E "RACECHECK SUMMARY|Race reported|sums" "$OUT/ring_race.log" | sort | uniq -c | head -12
fi

if has bench; then
  finish_warm
  python benchmarks/benchmark.py --out "$OUT" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" | tail -30
  save_triton_cache
fi
if has ab; then  # the baseline first (PYTHONPATH puts its package ahead of this tree's editable install)
  finish_warm
  for tree in "${!ab_pids[@]}"; do
    wait "${ab_pids[$tree]}" || { echo "ab: $tree did not build"; tail -20 "$OUT/${tree}_build.log"; exit 1; }
  done
  declare -A runs=()
  for tree in ${AB_ORDER:-base this}; do
    runs[$tree]=$(( ${runs[$tree]:-0} + 1 ))
    name=$tree
    if (( runs[$tree] > 1 )); then name+=${runs[$tree]}; fi
    echo "== $name"
    path=$([[ $tree == this ]] && echo "${PYTHONPATH:-}" || ab_tree "$tree")
    PYTHONPATH="$path" python benchmarks/benchmark.py --out "$OUT/$name" ${BENCH_ARGS:-} >"$OUT/bench_$name.log" 2>&1
    grep -E "^(bfloat16|float)|CUDA graph replay|relative error" "$OUT/bench_$name.log"
  done
fi
if has decode; then
  python benchmarks/decode_benchmark.py 2>&1 | tee "$OUT/decode.log" | tail -12
  status=$(( status | $? ))
  echo "through the chunked kernels' general path (FAST_CAUSAL_ATTN_KERNEL=chunked), for comparison:"
  FAST_CAUSAL_ATTN_KERNEL=chunked python benchmarks/decode_benchmark.py 2>&1 | tee "$OUT/decode_chunked.log" | tail -8
  status=$(( status | $? ))
fi
# a warm-up beside untimed stages (build tests, say) ends here, and its Triton cache comes back
finish_warm
# the tests' and sanitizers' outcomes again last, where later stages' output would push them out of
# the reply's tail
[[ -f "$OUT/summary.txt" ]] && { echo "== summary"; cat "$OUT/summary.txt"; }
exit $status
