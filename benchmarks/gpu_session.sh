#!/usr/bin/env bash
# The GPU measurements a session with a device machine owes issue #12, in one device call.
#
#   benchmarks/gpu_session.sh prepare [BEFORE]   here: wheels the device's Python 3.12
#                                                lacks into .whl/, the source tree at git
#                                                revision BEFORE (default 3c116c6, the tree
#                                                before engine groups) into .gpu/before/src
#   benchmarks/gpu_session.sh run [before]       on the device machine (the device tool's
#                                                run, carry [".whl", ".gpu"]): installs the
#                                                wheels into /tmp/site, runs make test-gpu,
#                                                then measures benchmarks/gpu.py on this
#                                                tree (figures into $OUT); with "before",
#                                                also on the tree before, first
#
# A task lent a device has 15 minutes of it, a machine's start included: "run" ends within
# about 6 minutes (timeout_s 420 leaves room for one more try), "run before" within 9.
#
# .whl/ and .gpu/ are ignored through .git/info/exclude (prepare adds them), so they travel
# only where the call carries them. docs/gpu.md reads the figures.
set -u
cd "$(dirname "$0")/.." || exit 1

# What the device's python lacks (its torch, numpy, grpcio, uvloop, prometheus-client,
# pyyaml, click, rich and psutil are there), and what transformers 5.23 needs beyond them.
WHEELS=(
  httptools==0.9.0 orjson==3.13.0 pydantic==2.14.3 pydantic-core==2.50.4
  annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0
  llguidance==1.9.1 pytest-asyncio==1.5.0 transformers==5.23.0 tokenizers==0.23.3
  huggingface-hub==2.4.0 safetensors==0.8.0 httpx2==2.16.2 httpcore2==2.16.2
  hf-xet==1.8.0 click==8.5.1 truststore==0.10.5 idna==3.20 anyio==4.16.0 h11==0.16.0
  py-spy==0.4.3
  # tests/gpu/test_cuda_shared_memory.py: tritonclient's gRPC client and cuda_shared_memory
  # (NVIDIA's cuda-bindings), httpx for the HTTP calls.
  tritonclient==2.73.0 cuda-bindings==13.5.0 cuda-pathfinder==1.9.1 protobuf==6.33.6
  python-rapidjson==1.25 ml-dtypes==0.5.4 packaging==26.3 urllib3==2.8.0 httpx==0.28.1
  httpcore==1.0.9 certifi==2026.10.18 sniffio==1.3.1
)

prepare() {
  local before=${1:-3c116c6}
  for path in /.whl/ /.gpu/; do
    grep -qxF "$path" .git/info/exclude || echo "$path" >>.git/info/exclude
  done
  mkdir -p .whl .gpu/before
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 -d .whl "${WHEELS[@]}" ||
    return 1
  rm -rf .gpu/before/src
  git archive "$before" src | tar -x -C .gpu/before
  du -sh .whl .gpu
}

run() {
  : "${OUT:?run it through the device tool, which sets OUT}"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl >"$OUT/pip.txt" 2>&1 || { tail -5 "$OUT/pip.txt"; return 1; }
  nvidia-smi --query-gpu=name,memory.used,utilization.gpu --format=csv >"$OUT/smi.txt" 2>&1
  export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
  # Correctness first: a GPU issue is not done until its tests pass on a GPU.
  PYTHONPATH=/tmp/site timeout 180 make test-gpu >"$OUT/test-gpu.txt" 2>&1
  echo "test-gpu rc=$?" >>"$OUT/test-gpu.txt"
  if [ "${1:-}" = before ]; then  # the FP16 HTTP and gRPC case only
    PYTHONPATH=.gpu/before/src:/tmp/site timeout 150 python3 benchmarks/gpu.py \
      --served fp16-graphs-i1-split4 --concurrency 256 --protocols http-binary,grpc \
      --duration 3 --json "$OUT/before.json" >"$OUT/before.txt" 2>&1
    echo "before rc=$?" >>"$OUT/before.txt"
    tail -6 "$OUT/before.txt"
  fi
  # FP16 with 4 and 8 front ends and FP32, at C=1 and 256, both protocols.
  PYTHONPATH=src:/tmp/site timeout 200 python3 benchmarks/gpu.py \
    --served fp16-graphs-i1-split4,fp16-graphs-i1-split8,fp32-graphs-i1-split4 \
    --concurrency 1,256 --duration 3 --json "$OUT/after.json" >"$OUT/after.txt" 2>&1
  echo "after rc=$?" >>"$OUT/after.txt"
  tail -3 "$OUT/test-gpu.txt"
  tail -12 "$OUT/after.txt"
}

case "${1:-}" in
  prepare) shift; prepare "$@" ;;
  run) shift; run "$@" ;;
  *) echo "usage: $0 prepare [BEFORE] | run [before]" >&2; exit 2 ;;
esac
