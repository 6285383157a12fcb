#!/usr/bin/env bash
# The GPU suite in one call on a GPU machine that has torch and Triton but no Ray, msgspec or
# network: install the carried wheels, build kvray's C helpers, then run tests/gpu,
# `kvray demo --device cuda` and the GPU benchmark, each one's output kept under $OUT.
#
# Here (once): download into .whl the wheels the GPU machine lacks (Ray 2.60.0, msgspec,
# pytest-asyncio, jsonschema and its dependencies), with /.whl/ ignored by git.
# There, from the repository root, carrying .whl:
#     bash tests/gpu/run_on_device.sh [tests] [demo] [bench] [launch] [staging] [connector]
#     (default: the first three)
# A real vLLM engine (vLLM 0.26.0, whose parts `tests/gpu/vllm_payload.sh` builds into .whl/vllm),
# in two calls on one warm machine, each carrying its parts (64 MiB a call):
#     carry .whl/vllm/A.tar.xz .whl/vllm/B.tar.xz:                  run_on_device.sh vllm-unpack
#     carry .whl/vllm/{C,F,M,D}.tar.xz:                             run_on_device.sh vllm-unpack vllm
# vllm-unpack unpacks the carried parts into .whl/site (kept between calls) and, once _C is
# there, loads it (an ABI check against the machine's torch); vllm builds the tiny models from
# the carried tokenizer and runs tests/gpu/vllm_pd_engines.py ($OUT/gpu-vllm.txt and .json).
# Outputs, named as their current copies in docs/results/: $OUT/gpu-tests.txt, $OUT/demo-cuda.txt,
# $OUT/gpu-request.txt and $OUT/gpu-request.json, $OUT/gpu-launch.txt (launch: where one write's
# host time goes), $OUT/gpu-staging.txt and .json (staging: GPU KV over the ray transport between
# two Ray nodes), $OUT/gpu-connector.txt and .json (connector: the vLLM connector's hand-off)
# ($OUT defaults to ./gpu-results). The exit status is the first failing step's.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-gpu-results}
mkdir -p "$out"
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(tests demo bench)
export PYTHONUNBUFFERED=1 RAY_ADDRESS= RAY_USAGE_STATS_ENABLED=0

if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
else
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
python3 setup.py -q build_ext --inplace >"$out/build.txt" 2>&1 || { cat "$out/build.txt"; exit 1; }
{
    date -u +"%Y-%m-%d %H:%M UTC"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
} | tee "$out/machine.txt"

status=0
for step in "${steps[@]}"; do
    case $step in
        tests)
            python3 -m pytest -v -p no:cacheprovider -rs tests/gpu 2>&1 | tee "$out/gpu-tests.txt"
            rc=${PIPESTATUS[0]} ;;
        demo)
            python3 -m kvray.cli demo --device cuda 2>&1 | tee "$out/demo-cuda.txt"
            rc=${PIPESTATUS[0]} ;;
        bench)
            python3 benchmarks/bench_gpu.py --same-gpu --no-nccl --repeat 10 --json "$out/gpu-request.json" 2>&1 \
                | tee "$out/gpu-request.txt"
            rc=${PIPESTATUS[0]} ;;
        launch)
            python3 benchmarks/bench_gpu_launch.py 2>&1 | tee "$out/gpu-launch.txt"
            rc=${PIPESTATUS[0]} ;;
        staging)
            python3 benchmarks/bench_gpu_staging.py --repeat 5 --json "$out/gpu-staging.json" 2>&1 \
                | tee "$out/gpu-staging.txt"
            rc=${PIPESTATUS[0]} ;;
        connector)
            PYTHONPATH=$PWD/tests/gpu:$PYTHONPATH python3 benchmarks/bench_gpu_connector.py --repeat 10 --breakdown --lane both \
                --json "$out/gpu-connector.json" 2>&1 | tee "$out/gpu-connector.txt"
            rc=${PIPESTATUS[0]} ;;
        vllm-unpack)
            mkdir -p .whl/site .whl/models
            for part in .whl/vllm/*.tar.xz; do
                [ -f "$part" ] || continue
                case $(basename "$part") in M.tar.xz) into=.whl/models ;; *) into=.whl/site ;; esac
                python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter="data")' \
                    "$part" "$into" && echo "unpacked $part" && rm -f "$part"
            done
            rc=0
            if [ -f .whl/site/vllm/_C_stable_libtorch.abi3.so ]; then
                python3 -c 'import torch; torch.ops.load_library(".whl/site/vllm/_C_stable_libtorch.abi3.so"); print("vLLM _C loads")'
                rc=$?
            fi ;;
        vllm)
            test -f .whl/site/vllm/_C_stable_libtorch.abi3.so || { echo "vLLM is not unpacked here (the first call's parts)"; exit 3; }
            (
                export PYTHONPATH=$PWD/.whl/site:$PYTHONPATH HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
                # tiny-hybrid (two KV cache groups) is refused on vLLM 0.26: shown on the CPU.
                models=(tiny-llama-gqa tiny-deepseek)
                for model in "${models[@]}"; do
                    python3 -m kvray.cli model "$model" --cache .whl/models >/dev/null || exit 1
                done
                python3 tests/gpu/vllm_pd_engines.py --cache .whl/models --models "${models[@]}" --prompts 16 \
                    --json "$out/gpu-vllm.json" 2>&1 \
                    | grep -v "^(EngineCore\|^(Worker\| INFO \| WARNING " | tee "$out/gpu-vllm.txt"
                exit "${PIPESTATUS[0]}"
            )
            rc=$? ;;
        *)
            echo "unknown step $step (tests, demo, bench, launch, staging, connector, vllm-unpack, vllm)"; rc=2 ;;
    esac
    echo "== $step: exit $rc"
    [ "$status" -eq 0 ] && status=$rc
done
exit "$status"
