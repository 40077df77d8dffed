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
run "$PY" -m pytest -q -p no:cacheprovider tests/test_cuda.py
run "$PY" bench/gpu_stages.py --batch 8 --seq 512 --steps 10
run "$PY" bench/host_overhead.py --stages 2 4 --steps 10 --rounds 1
exit $status
