#!/usr/bin/env bash
# buf lint and format check of protos/, then buf breaking against every earlier commit of main
# that changed protos/: a published v1 contract never breaks (field numbers, names, types).
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
buf lint
buf format --diff --exit-code
echo "buf lint: ok"

commits=$(git log --format=%H -n 50 HEAD -- protos buf.yaml 2>/dev/null || true)
if [ -z "$commits" ]; then
  echo "buf breaking: skipped (no earlier commit has protos)"
  exit 0
fi
n=0
for commit in $commits; do
  buf breaking --against ".git#ref=${commit},subdir=protos"
  n=$((n + 1))
done
echo "buf breaking: ok against ${n} earlier version(s) of protos/"
