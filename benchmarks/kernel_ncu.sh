#!/usr/bin/env bash
# Nsight Compute's view of the two attention kernels issue 33 wants faster, as
# benchmarks/attention_gpu.py runs them: flash_prefill (bf16, D=128, 32/8 heads, T=4096) and
# paged_decode (B=64, context 4096), the third launch of each (after attention_gpu's parity
# check and a warm-up): speed of light, occupancy, launch statistics, memory workload, warp
# states and the scheduler: what the next kernel change is chosen from, without GPU time.
#
#   bash benchmarks/kernel_ncu.sh            # GPU host, after build/gpu-cache/env.sh
#
# ncu needs the hardware counters: Firecracker GPU hosts give them (with --clock-control none,
# leaving the clocks as they are), gVisor ones do not. Where they are missing this says so and
# exits 0: it informs, it checks nothing.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
PY=${PYTHON:-python3}
# ncu from PATH, else where CUDA images install it (the GPU image's PATH is not on record)
NCU=${NCU:-$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)}
if [[ -z $NCU ]] || ! command -v "$NCU" >/dev/null; then
  echo "kernel_ncu: no ncu on this host (PATH, /opt/nvidia/nsight-compute, /usr/local/cuda*/bin)"
  exit 0
fi
echo "kernel_ncu: $NCU"
sections=(--section SpeedOfLight --section Occupancy --section LaunchStats
  --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats)
# PTX entry names (kernels/ptx.py wrapper_name): mk_fa_* flash_prefill, mk_pd<G>_* paged_decode.
for entry in 'mk_fa_bf16_d128' 'mk_pd[0-9]_bf16_d128'; do
  echo "== ncu: $entry"
  "$NCU" --clock-control none --kernel-name "regex:$entry" --launch-skip 2 --launch-count 1 \
    "${sections[@]}" "$PY" benchmarks/attention_gpu.py --lengths 4096 --decode 64x4096 --iters 3
  rc=$?
  ((rc == 0)) || echo "kernel_ncu: ncu exit $rc for $entry (no hardware counters on this host?)"
done
exit 0
