#!/usr/bin/env bash
# The GPU checks, one command, the same every time: the CUDA tests (stages on one GPU, CUDA
# streams, NCCL where there are two GPUs), the stages on one GPU against the unsplit model
# (bench/gpu_stages.py; the program steps with every stage on one thread and with a thread per
# stage, and the reference runtime), and the host time per step (bench/host_overhead.py). Each part runs
# even when one before it failed; the exit status says whether any did.
#
#     bash bench/gpu_check.sh            # on a machine with a CUDA GPU, from the repository root
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
status=0
run() { echo "== $*"; "$@" || status=1; }
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
run "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'GPUs', torch.cuda.device_count())"
# Step programs need greenlet, which a bare CUDA image may lack (the lent H200's did, 2026-11-28).
if ! "$PY" -c "import greenlet" 2>/dev/null; then
  echo "greenlet is missing: step programs cannot run. Bring its wheel, e.g. from a machine with pip:" >&2
  echo "  pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 -d .whl greenlet" >&2
  echo "  then here: pip install --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:\$PWD" >&2
  exit 2
fi
run "$PY" -m pytest -q -p no:cacheprovider tests/test_cuda.py
run "$PY" bench/gpu_stages.py --batch 8 --seq 512 --steps 10
run "$PY" bench/host_overhead.py --stages 2 4 --steps 10 --rounds 1
exit $status
