#!/usr/bin/env bash
# The GPU part of the performance plan in one command, for a machine with an NVIDIA GPU and a CUDA build of
# torch already installed (nothing is downloaded): the CUDA tests, then the GPU overhead benchmark (step
# overhead of wg and all, engine vs the _foreach_norm floor, host syncs, accuracy on the GPU).
#   bash benchmarks/gpu.sh [OUT_DIR]       results: OUT_DIR/{nvidia-smi.txt,tests.log,gpu_overhead.json,profile.txt,
#                                            compile.json,gpu_hold_{full,small}.json,profile_hold_*.txt,
#                                            bench.log}
# GPU_HOLD=0 leaves out the hold runs (about 2 minutes) where device time is short.
# ~7 minutes on an H200 (tests 3; with GPU_HOLD=0 about 5, 290 s in session 30). That is a dozen files: where only a few files come back from the machine,
# write them elsewhere and pack them: bash benchmarks/gpu.sh /tmp/r; tar czf "$OUT/r.tgz" -C /tmp r
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-/tmp/trainermon-gpu}}
mkdir -p "$out"
: >"$out/bench.log"  # the runs below append to it
py=${PYTHON:-python3}
"$py" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device visible to torch')" || exit 2
# trainermon itself, against the machine's own torch (no dependency resolution, no network); the native CPU
# kernel is optional and builds when a compiler is there.
# Without it the tests and the benchmark import trainermon from this checkout all the same.
"$py" -m pip install -q --no-deps --no-build-isolation -e . >"$out/install.log" 2>&1 ||
  echo "editable install failed (see $out/install.log); using the checkout"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi >"$out/nvidia-smi.txt" 2>&1
# The tests that exercise the device path (the sync-debug test and the compiled-taps test on CUDA are
# skipped on machines without CUDA).
"$py" -m pytest -q -rs tests/unit/test_transfers.py tests/unit/test_stats.py tests/unit/test_engine_accuracy.py \
  tests/unit/test_graph_taps*.py tests/unit/test_triton_stats.py tests/unit/test_cuda_graphs.py \
  tests/unit/test_hook_batches.py tests/unit/test_clipping.py tests/unit/test_nccl_merge.py \
  2>&1 | tee "$out/tests.log"
tests_rc=${PIPESTATUS[0]}
# torch.compile (inductor, CUDA) with and without the monitor against the same model run eagerly (issue 23:
# the compiled overhead at most 2x the eager one), graphs and graph breaks; with the forward_only arms in
# the same rounds (actv alone in both modes: like for like on a torch older than 2.12, whose compiled graphs
# write no actv_grad rows; two separate runs differed by more than the overhead, session 30).
PYTHONUNBUFFERED=1 "$py" benchmarks/bench_compile.py --device cuda --rounds 5 --steps 45 --width 1024 --both --hold0 \
  --json "$out/compile.json" 2>&1 | tee -a "$out/bench.log"
compile_rc=${PIPESTATUS[0]}
PYTHONUNBUFFERED=1 "$py" benchmarks/gpu_overhead.py --json "$out/gpu_overhead.json" --profile "$out/profile.txt" 2>&1 | tee -a "$out/bench.log"
bench_rc=${PIPESTATUS[0]}
# The hook batches: `all` with the GPU's hold (256 MiB of hook tensors per batched engine call, since
# session 23) against `all-hold2` (2 MiB, the CPU's), on the workload of record and on a small model whose
# step leaves the hooks' host time exposed.
for size in full small; do
  [ "${GPU_HOLD:-1}" = 0 ] && break
  arms=none,all,all-hold2
  [ "$size" = small ] && arms=none,wg,all,all-hold2
  PYTHONUNBUFFERED=1 "$py" benchmarks/gpu_overhead.py --size "$size" --arms "$arms" --overhead-only \
    --json "$out/gpu_hold_$size.json" --profile "$out/profile_hold_$size.txt" 2>&1 | tee -a "$out/bench.log"
  [ "${PIPESTATUS[0]}" = 0 ] || bench_rc=1
done
echo "tests rc=$tests_rc, compile rc=$compile_rc, benchmark rc=$bench_rc; results in $out"
[ "$tests_rc" = 0 ] && [ "$compile_rc" = 0 ] && [ "$bench_rc" = 0 ]
