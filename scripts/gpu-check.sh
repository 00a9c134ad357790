#!/usr/bin/env bash
# The GPU checks in one run, on a machine with a CUDA device, torch, cupy and triton already installed:
# builds the C extension, runs the tests that use a device (tests/core at 3 ranks, a non-power of two, where
# every parametrised kind includes torch-cuda and real cupy; the GPU training tests at 2 and 3 ranks), then
# benchmarks/device.py for torch and cupy at 4 ranks sharing the one GPU.
#
#   bash scripts/gpu-check.sh OUTDIR [WHEELDIR]
#
# STEPS (default "tests bench train"; also "kernels") chooses the parts; train runs examples/train.py for 5 epochs at 4 ranks
# on the GPU, with and without overlap and AMP, and on the CPU (it needs mnist1d).
#
# WHEELDIR, when given, holds wheels (mpich, mpi4py, pytest-mpi) installed first into a private folder, for
# a machine whose Python lacks them and can reach no package index. Every step has its own time limit, and
# the script goes on after a failing step; the exit status says whether any failed.
set -u
out=${1:?usage: gpu-check.sh OUTDIR [WHEELDIR]}
wheels=${2:-}
mkdir -p "$out"
py=${PYTHON:-python3}
if [ -n "$wheels" ]; then
    $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/adasum-site \
        "$wheels"/*.whl || exit 1
    export PYTHONPATH=/tmp/adasum-site:${PYTHONPATH:-}
    # the image's own mpi4py may hold another MPI: make mpi4py load the carried MPICH, whose mpiexec is first
    # (pip's --target keeps a wheel's bin/ but drops its lib/, so the libraries are unpacked from it)
    $py -c "import glob, zipfile
for w in glob.glob('$wheels/mpich-*.whl'):
    z = zipfile.ZipFile(w)
    for n in z.namelist():
        if '.data/data/lib/' in n:
            z.extract(n, '/tmp/adasum-mpich')
for d in glob.glob('/tmp/adasum-mpich/*.data/data/lib'):
    print('MPICH libraries from', d)" || exit 1
    export PATH=/tmp/adasum-site/bin:$PATH LD_LIBRARY_PATH=$(echo /tmp/adasum-mpich/*.data/data/lib):${LD_LIBRARY_PATH:-}
    export MPI4PY_MPIABI=mpich MPI4PY_LIBMPI=$(echo /tmp/adasum-mpich/*.data/data/lib)/libmpi.so.12
fi
export PYTHONPATH=$PWD:$PWD/tests:${PYTHONPATH:-} OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1 MPIEXEC_TIMEOUT=400
failed=0
step() {  # step NAME SECONDS COMMAND...
    local name=$1 limit=$2
    shift 2
    echo "===== $name (limit ${limit}s)"
    local t0=$SECONDS
    timeout -k 5 "$limit" "$@"
    local rc=$?
    echo "===== $name: exit $rc after $((SECONDS - t0)) s"
    [ $rc -eq 0 ] || failed=1
}
nvidia-smi -L
$py -c "import torch, cupy, triton, mpi4py, numpy; print('torch', torch.__version__, torch.cuda.get_device_name(),
      '| cupy', cupy.__version__, '| triton', triton.__version__, '| mpi4py', mpi4py.__version__, '| numpy', numpy.__version__)"
$py -m mpi4py --mpi-lib-version | head -1
mpiexec -n 2 $py -m mpi4py -c "from mpi4py import MPI; c = MPI.COMM_WORLD; print('rank', c.rank, 'of', c.size)"
step build 120 $py setup.py -q build_ext --inplace
$py -c "import adasum; print('kernels:', adasum.kernels_backend(), '| cuda-aware MPI:', adasum.cuda_aware_mpi())"
pytest_mpi="-m mpi4py -m pytest -q -p no:cacheprovider --with-mpi -m mpi --timeout 150 -rs"
want() { [[ " ${STEPS:-tests bench train} " == *" $1 "* ]]; }
if want tests; then
step "gpu tests np=2" 150 mpiexec -n 2 $py $pytest_mpi tests/core/test_gpu.py tests/training/test_gpu_training.py
step "core tests np=3" 200 mpiexec -n 3 $py $pytest_mpi tests/core tests/training/test_gpu_training.py
fi
if want bench; then
step "device benchmark torch np=4" 100 mpiexec -n 4 $py benchmarks/device.py --kind torch \
    --sizes 1MiB,16MiB,64MiB --json "$out/device-torch-np4.json"
step "device benchmark cupy np=4" 70 mpiexec -n 4 $py benchmarks/device.py --kind cupy \
    --sizes 1MiB,16MiB,64MiB --json "$out/device-cupy-np4.json"
fi
if want kernels; then  # the segmented Triton kernels against the per-layer ones, torch at 4 ranks
    for k in triton per-layer; do
        step "device benchmark torch np=4, $k kernels" 60 mpiexec -n 4 $py benchmarks/device.py --kind torch \
            --sizes 4MiB,64MiB --methods host,staged --kernels $k --json "$out/device-torch-np4-$k.json"
    done
fi
if want train; then  # the README's training example, 4 ranks on the one GPU, against the CPU run of the same seed
    train="mpiexec -n 4 $py -m mpi4py examples/train.py --epochs 5 --no-progress"
    step "train cuda" 120 $train --device cuda --metrics-json "$out/train-cuda.json"
    step "train cuda overlap amp" 120 $train --device cuda --overlap --amp --metrics-json "$out/train-cuda-amp.json"
    step "train cpu" 120 $train --metrics-json "$out/train-cpu.json"
    for f in "$out"/train-*.json; do echo "$f: $(cat "$f")"; done
fi
exit $failed
