#!/usr/bin/env bash
# Every GPU check of obsckpt in one call, for a machine with CUDA:
#   1. the gpu-marked tests (NCCL formation and failure cases, FSDP1 and FSDP2 on CUDA,
#      CUDA IPC sync, device selection, the demo on the GPU);
#   2. the CPU-side tests of paths that broke on a GPU machine (formation with the
#      default NCCL backend, FSDP2 ranks without a GPU on a CUDA machine);
#   3. the GPU benchmarks (benchmarks/run.py --quick --only gpu,peers: staging stall, pinned
#      bytes, first save, overlapped stall, ipc sync; torch DCP and torch.save on a GPU
#      state), and the ipc sync alone at the full size (--only ipc);
#   4. in a call of its own (GPU_CHECK_PHASES=suite) the rest of the suite, without the
#      tests that need promtool, prometheus, strace, a package index or the installed
#      console script (markers needs_promtool, needs_strace, needs_index, needs_install),
#      on GPU_CHECK_WORKERS pytest-xdist workers (default 4; 0: none).
#
# Usage: scripts/gpu_check.sh LOG_DIR        (or: make gpu-check LOG_DIR=...)
# Environment: PYTHON (default python3), GPU_CHECK_PHASES (default "tests regressions
# bench"; "suite" for phase 4), GPU_CHECK_WORKERS, EXTRA_SITE (a directory
# of extra packages put first on PYTHONPATH, e.g. Ray unpacked where none is installed).
# Writes LOG_DIR/{env.txt,gpu-tests.*,gpu-regressions.*,gpu-bench{,-ipc}.{log,json},suite.log,
# summary.txt}; exits non-zero if any phase failed.
set -u
out=${1:?usage: scripts/gpu_check.sh LOG_DIR}
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONPATH="${EXTRA_SITE:+$EXTRA_SITE:}$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 RAY_USAGE_STATS_ENABLED=0 RAY_DEDUP_LOGS=0
start=$(date +%s)
# Bytecode for the carried packages, once: where PYTHONDONTWRITEBYTECODE is set, every
# Ray worker and rank would otherwise compile their sources again at import.
if [ -n "${EXTRA_SITE:-}" ] && [ -n "${PYTHONDONTWRITEBYTECODE:-}" ]; then
  "$PY" -m compileall -q -j 0 "$EXTRA_SITE" > /dev/null 2>&1 || true
fi

{
  date -u
  nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv 2>&1 || true
  "$PY" -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__,
"cuda", torch.version.cuda, "devices", torch.cuda.device_count())'
  "$PY" -c 'import ray; print("ray", ray.__version__)' 2>&1 | tail -1
  echo "PYTHONDONTWRITEBYTECODE=${PYTHONDONTWRITEBYTECODE:-}; setup took $(( $(date +%s) - start )) s"
} > "$out/env.txt" 2>&1
cat "$out/env.txt"
if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "no CUDA device here: the GPU checks cannot run (GPU_CHECK_ALLOW_CPU=1 runs them anyway," \
    "to check this script; every GPU test then skips)" | tee "$out/summary.txt"
  [ "${GPU_CHECK_ALLOW_CPU:-0}" = 1 ] || exit 2
fi

phase() {  # name, seconds, command...
  local name=$1 limit=$2
  shift 2
  local t0 rc
  t0=$(date +%s)
  timeout --kill-after=10 "$limit" "$@" > "$out/$name.log" 2>&1
  rc=$?
  tail -n 25 "$out/$name.log"
  echo "$name: exit $rc after $(( $(date +%s) - t0 )) s" | tee -a "$out/summary.txt"
  return $rc
}

touch "$out/summary.txt"
failed=0
want() { case " ${GPU_CHECK_PHASES:-tests regressions bench} " in *" $1 "*) return 0 ;; esac; return 1; }
want tests && { phase gpu-tests 260 "$PY" -m pytest -q -p no:cacheprovider -rs -m gpu --continue-on-collection-errors \
  --junitxml="$out/gpu-tests.xml" tests || failed=1; }
# The paths that failed on a GPU machine before: the formation check with the default
# (NCCL) backend, and FSDP2 ranks without a GPU on a machine with CUDA.
want regressions && { phase gpu-regressions 130 "$PY" -m pytest -q -p no:cacheprovider -rs \
  --junitxml="$out/gpu-regressions.xml" tests/test_broadcast.py::TestTimeouts \
  tests/test_broadcast.py::TestFormation \
  tests/test_verl_fsdp.py::test_fsdp2_checkpoint_memory_and_broadcast_sync || failed=1; }
want bench && { phase gpu-bench 120 "$PY" benchmarks/run.py --quick --only gpu,peers \
  --json "$out/gpu-bench.json" || failed=1; }
# The colocated sync again at the full size (1 GiB and 4 GiB states), where its target is set.
want bench && { phase gpu-bench-ipc 80 "$PY" benchmarks/run.py --only ipc \
  --json "$out/gpu-bench-ipc.json" || failed=1; }
if want suite; then
  workers=${GPU_CHECK_WORKERS:-4}
  phase suite "${GPU_CHECK_SUITE_S:-560}" "$PY" -m pytest -q -p no:cacheprovider -rs \
    $([ "$workers" != 0 ] && echo "-n $workers --dist loadfile") --junitxml="$out/suite.xml" \
    -m "not gpu and not needs_promtool and not needs_strace and not needs_index and not needs_install" \
    tests \
    || failed=1
fi
echo "total: $(( $(date +%s) - start )) s, $( [ $failed = 0 ] && echo ok || echo FAILED )" \
  | tee -a "$out/summary.txt"
exit $failed
