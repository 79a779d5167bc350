#!/usr/bin/env bash
# Where the services' threads spend a loaded `mili serve`'s time: py-spy samples of the
# prefill, decode and frontend processes while benchmarks/serve_gpu.py runs its saturated
# level, one collapsed-stack file per process (py-spy's raw format, one line per distinct
# stack with its sample count; thread names and idle samples kept: a thread waiting on the GPU
# or the GIL shows where it waits), and decode's again with only its GIL holders' samples
# (serve-decode-gil.txt): what the first shows busy and the second does not is a GIL wait.
#
#   python3 -m pip download --no-deps --only-binary=:all: -d .whl py-spy   # here, with prep
#   bash benchmarks/serve_profile.sh                   # GPU host (build/gpu-cache/env.sh installs it)
#   DEVICE=cpu PRESET=tiny bash benchmarks/serve_profile.sh               # a check, anywhere
# Read: python3 benchmarks/stacks.py $OUT/serve-prefill.txt
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
out=${OUT:-build/profile}
mkdir -p "$out" && out=$(cd "$out" && pwd)
PY=${PYTHON:-python3}
device=${DEVICE:-cuda}
preset=${PRESET:-qwen3-0.6b}
seconds=${SECONDS_SAMPLED:-12}
if [[ $device == cuda && -f build/gpu-cache/env.sh && -z ${MILI_CACHE_DIR:-} ]]; then
  # (gpu_check.sh has sourced it already: MILI_CACHE_DIR set)
  # shellcheck source=/dev/null
  source build/gpu-cache/env.sh >>"$out/env.txt" 2>&1
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
spy=$(command -v py-spy || echo /tmp/site/bin/py-spy)
log=$out/serve_profile.log
"$PY" benchmarks/serve_gpu.py --device "$device" --preset "$preset" --attention auto \
  --ttft-requests 10 --warmup 4 --concurrency "${CONCURRENCY:-256}" >"$log" 2>&1 &
bench=$!
until grep -q "^concurrency 1 " "$log" 2>/dev/null; do
  kill -0 "$bench" 2>/dev/null || { echo "serve_gpu ended first:"; tail -20 "$log"; exit 1; }
  sleep 0.5
done
sleep "${DELAY:-2}"
spies=()
for name in serve-prefill serve-decode serve-frontend; do
  pid=$(pgrep -f -- "-m mili $name" | head -1)
  if [[ -z $pid ]]; then
    echo "no $name process" | tee -a "$log"
    continue
  fi
  "$spy" record --pid "$pid" --duration "$seconds" --rate 250 --format raw --idle --threads \
    --nonblocking --output "$out/$name.txt" >>"$out/py-spy.log" 2>&1 &
  spies+=("$!")
  if [[ $name == serve-decode ]]; then
    # The same window with only the samples of a thread holding the GIL: a line that is busy
    # above and rare here (run 6: the batcher's torch calls in DecodeInputs.fill, 20% of its
    # samples) waits to take the GIL back rather than working. Informative: not in rc.
    "$spy" record --pid "$pid" --duration "$seconds" --rate 250 --format raw --gil --threads \
      --nonblocking --output "$out/$name-gil.txt" >>"$out/py-spy.log" 2>&1 &
    gil_spy=$!
  fi
done
# The samples are what this is for: wait for py-spy alone (serve_gpu's run goes on for half a
# minute more), then end the run; fail, with py-spy's words, unless every process was sampled.
rc=0
for p in "${spies[@]}"; do wait "$p" || rc=1; done
[[ -n ${gil_spy:-} ]] && { wait "$gil_spy" || echo "py-spy --gil of serve-decode failed (see py-spy.log)"; }
# serve_gpu.py drains and stops `mili serve` on SIGTERM, its services die with the launcher:
# wait for all of them (the next piece needs the device's memory), and say if any stay.
served=$(pgrep -P "$bench" -f -- "-m mili serve")
for p in $served; do served+=" $(pgrep -P "$p" | tr '\n' ' ')"; done
kill "$bench" 2>/dev/null
wait "$bench" 2>/dev/null
for _ in $(seq 40); do
  alive=$(for p in $served; do kill -0 "$p" 2>/dev/null && echo "$p"; done)
  [[ -z $alive ]] && break
  sleep 0.5
done
if [[ -n $alive ]]; then
  echo "mili serve processes left running: ${alive//$'\n'/ }" | tee -a "$log"
  rc=1
fi
for name in serve-prefill serve-decode serve-frontend; do
  [[ -s $out/$name.txt ]] || { echo "no samples of $name" | tee -a "$log"; rc=1; }
done
((rc == 0)) || cat "$out/py-spy.log" 2>/dev/null
tail -8 "$log"
ls -la "$out"
exit "$rc"
