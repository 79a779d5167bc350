#!/usr/bin/env bash
# Prepare the GPU check here (CPU machine), from the checkout's root:   bash benchmarks/gpu_prep.sh
#
# ../shared/gpu/prep.sh makes .whl/ (the wheels the GPU image lacks) and build/gpu-cache/ (this
# checkout's sm_90 PTX and env.sh, which installs every .whl/*.whl on the GPU host). Its list
# predates structured output: the GPU image has no llguidance, which the prefill, decode and
# frontend servers import (the engine alone runs without it). This runs prep.sh, then adds the
# wheels this checkout needs beyond its list, at the versions constraints.txt pins, for the GPU
# host's CPython 3.12 x86-64. Then, with the device tool:
#   run(command="bash benchmarks/gpu_check.sh", carry=[".whl", "build/gpu-cache"], timeout_s=600)
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
# Fresh wheels each time: a pin changed since the last prep would leave two versions of one
# package in .whl, and env.sh's one `pip install .whl/*.whl` on the GPU host would then fail.
rm -rf .whl
bash ../shared/gpu/prep.sh
# llguidance's wheels are manylinux_2_31 (prep.sh asks for 2_28 and older: it would find none).
extra=(llguidance)
for name in "${extra[@]}"; do
  spec=$(grep -iE "^${name//-/[-_]}==" constraints.txt | head -1 || true)
  [ -n "$spec" ] || { echo "gpu_prep: $name is not pinned in constraints.txt" >&2; exit 1; }
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_35_x86_64 --platform manylinux_2_34_x86_64 \
    --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl "$spec"
done
# py-spy for benchmarks/serve_profile.sh: a tool, not a dependency of the project, so pinned here.
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 -d .whl \
  py-spy==0.4.3
ls .whl | grep -iE "^($(IFS='|'; echo "${extra[*]}"))-" || { echo "gpu_prep: a wheel is missing" >&2; exit 1; }
du -sh .whl build/gpu-cache
