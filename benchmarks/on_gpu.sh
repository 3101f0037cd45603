#!/usr/bin/env bash
# The speed benchmarks that have a GPU side, one after another on one CUDA GPU,
# each under a time limit so that one that fails or overruns leaves the others'
# numbers (BENCHMARKS.md, "On an NVIDIA H200"):
#   torch_kron   peer_speed.py, torch Kron vs kron-torch (and the floors) on cuda
#   jax_kron     peer_speed.py, JAX Kron vs distributed-kron
#   shampoo      peer_speed.py, Shampoo vs Google's (and its floor)
#   kron_update  kron_update.py: JAX Kron vs AdamW, share of the matmul peak
# (their limits fit one 10-minute call: on an H200 they took 70, 97, 130 and
# 86 s, most of it compilation); and, only when named:
#   torch_step   torch_kron.py --device cuda: torch Kron eager and with
#                compile_kernels=True vs AdamW (not yet run on a GPU)
# Usage, from the repository root, with precond's dependencies and the peers
# (the parity extra) importable, or the peers' wheels in .whl/ (for a machine
# with no package index; `pip download --no-deps -d .whl distributed-kron==1.0.0
# kron-torch==0.1.0 optax-shampoo==0.0.6`), which are installed first:
#   bash benchmarks/on_gpu.sh OUT_DIR [ROUNDS [STEP...]]
# STEPs default to the first four. Each step's output goes to OUT_DIR/all.log and
# its tables to stdout; each peer_speed step also writes OUT_DIR/<step>.json.
set -u
out=${1:?usage: on_gpu.sh OUT_DIR [ROUNDS [STEP...]]}
rounds=${2:-5}
shift $(($# < 2 ? $# : 2))
chosen=" ${*:-torch_kron jax_kron shampoo kron_update} "
mkdir -p "$out"
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"
if compgen -G ".whl/*.whl" >/dev/null; then
  site=$(mktemp -d)
  python3 -m pip install -q --no-index --no-deps --target "$site" .whl/*.whl || exit 1
  export PYTHONPATH="$PYTHONPATH:$site"
fi
# JAX and torch share the GPU: JAX takes memory as it needs it, not 75% at start.
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
log="$out/all.log"

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm \
  --format=csv | tee -a "$log"
python3 -c 'import jax, torch; print("jax", jax.__version__, jax.devices(),
  "torch", torch.__version__, torch.version.cuda)' 2>&1 | tee -a "$log"

step() {  # step NAME SECONDS COMMAND...: run it, keep its tables
  local name=$1 seconds=$2
  shift 2
  [[ $chosen == *" $name "* ]] || return 0
  echo "== $name (limit ${seconds}s): $*" | tee -a "$log"
  local start=$SECONDS
  timeout "$seconds" "$@" >"$out/$name.log" 2>&1
  local status=$?
  echo "== $name: exit $status, $((SECONDS - start))s" | tee -a "$log"
  cat "$out/$name.log" >>"$log"
  grep -E '^\||^- |^[A-Za-z].*(GFLOP|TFLOP|peak)' "$out/$name.log" | grep -v '^|---'
  [ "$status" = 0 ] || tail -n 8 "$out/$name.log"
  rm "$out/$name.log"
}

peer=benchmarks/peer_speed.py
step torch_kron 120 python3 $peer --torch-device cuda --pairs torch-kron \
  --rounds "$rounds" --json "$out/torch_kron.json"
step jax_kron 140 python3 $peer --pairs jax-kron \
  --rounds "$rounds" --json "$out/jax_kron.json"
step shampoo 190 python3 $peer --pairs shampoo \
  --rounds "$rounds" --json "$out/shampoo.json"
step kron_update 130 python3 benchmarks/kron_update.py
step torch_step 300 python3 benchmarks/torch_kron.py --device cuda --no-profile
