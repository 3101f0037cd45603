#!/usr/bin/env bash
# The speed benchmarks that have a GPU side, one after another on one CUDA GPU,
# each under a time limit so that one that fails or overruns leaves the others'
# numbers (BENCHMARKS.md, "On an NVIDIA H200"):
#   torch_kron   peer_speed.py, torch Kron vs kron-torch (and the floors) on cuda
#   jax_kron     peer_speed.py, JAX Kron vs distributed-kron
#   shampoo      peer_speed.py, Shampoo vs Google's (and its floor)
#   kron_update  kron_update.py: JAX Kron vs AdamW, share of the matmul peak
# (their limits fit one 10-minute call: on an H200 they took 70, 97, 130 and
# 86 s, most of it compilation).
# Usage, from the repository root, with precond's dependencies and the peers
# (the parity and peers extras) importable:
#   bash benchmarks/on_gpu.sh OUT_DIR [ROUNDS]
# Each step's output goes to OUT_DIR/all.log and its tables to stdout; each
# peer_speed step also writes OUT_DIR/<step>.json.
set -u
out=${1:?usage: on_gpu.sh OUT_DIR [ROUNDS]}
rounds=${2:-5}
mkdir -p "$out"
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"
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
