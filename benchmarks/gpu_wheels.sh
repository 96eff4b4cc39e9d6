#!/usr/bin/env bash
# Wheels for benchmarks/gpu_session.sh's torchtitan part: the GPU image (Python 3.12, torch,
# transformers, tokenizers, pyarrow, tensorboard...) has no torchtitan and cannot fetch.
# Run here, at the repository root; then name `.whl` in the device run's `carry`.
# Versions: those galore2's test environment runs torchtitan with.
set -eu
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >>"$(git rev-parse --git-dir)/info/exclude"
for pkg in torchtitan==0.3.0 spmd_types==0.2.3 tyro==1.0.17 docstring-parser==0.18.0 \
    typeguard==4.6.1 torchdata==0.11.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d .whl "$pkg"
done
ls -la .whl
