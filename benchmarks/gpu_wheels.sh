#!/usr/bin/env bash
# Wheels for benchmarks/gpu_session.sh's torchtitan part: the GPU image (Python 3.12, torch,
# transformers, tokenizers, pyarrow, tensorboard...) has no torchtitan and cannot fetch.
# Run here, at the repository root; then name `.whl` in the device run's `carry`.
# Which torchtitan the GPU's torch needs is known only there: both are downloaded, each into
# .whl/torchtitan-<version>/ (0.3.0: torch >= 2.12; 0.2.2: older torch, e.g. 2.11), and
# gpu_session.sh installs the one `python -m benchmarks.torchtitan_wheel` picks for it.
# GPU_TORCH=2.11 bash benchmarks/gpu_wheels.sh downloads only the one for that torch.
# Versions: those galore2's tests run torchtitan with.
set -eu
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >>"$(git rev-parse --git-dir)/info/exclude"
download() {  # download DEST PACKAGE...
    local dest=$1
    shift
    for pkg in "$@"; do
        python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
            --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
            --platform manylinux2014_x86_64 -d "$dest" "$pkg"
    done
}
download .whl tyro==1.0.17 docstring-parser==0.18.0 typeguard==4.6.1 torchdata==0.11.0 \
    datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
if [ -n "${GPU_TORCH:-}" ]; then
    versions=$(python3 -m benchmarks.torchtitan_wheel "$GPU_TORCH")
else
    versions="0.3.0 0.2.2"
fi
for v in $versions; do
    case $v in
    0.3.0) download .whl/torchtitan-0.3.0 torchtitan==0.3.0 spmd_types==0.2.3 ;;
    *) download ".whl/torchtitan-$v" "torchtitan==$v" ;;
    esac
done
ls -laR .whl
