#!/usr/bin/env bash
# buf lint and format check of protos/, then buf breaking against every release: each git tag
# named like a version (v0.1.0, v1.2.3). A released v1 contract never breaks (field numbers,
# names, types); what changed between releases is free to change. No release is tagged yet, so
# buf breaking has nothing to compare against until the first one.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
buf lint
buf format --diff --exit-code
echo "buf lint: ok"

# The repository's own git directory (a worktree's .git is a file naming it).
git_dir=$(git rev-parse --path-format=absolute --git-common-dir)
releases=$(git tag --list 'v[0-9]*.[0-9]*.[0-9]*')
if [ -z "$releases" ]; then
  echo "buf breaking: skipped (no release tag v*.*.* yet)"
  exit 0
fi
n=0
for tag in $releases; do
  buf breaking --against "${git_dir}#tag=${tag},subdir=protos"
  n=$((n + 1))
done
echo "buf breaking: ok against ${n} release(s)"
