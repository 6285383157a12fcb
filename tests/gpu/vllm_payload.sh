#!/usr/bin/env bash
# Builds into .whl/vllm/ what `run_on_device.sh vllm` carries to the GPU machine (Python 3.12,
# torch 2.11.0+cu130, no network, 64 MiB carried a call): vLLM 0.26.0, the newest release built
# for torch 2.11 (CUDA 13.0), cut to what an eager engine with FlashAttention 3 or FlashMLA
# imports, as xz tar parts that unpack into one site folder:
#   first call:  A (vLLM's Python and small ops), B (_C)                              ~59 MB
#   second call: C (FlashAttention 3), F (the runtime wheels vLLM imports that the GPU image
#                lacks), M (SmolLM2's tokenizer and config: the tiny models are built there),
#                D (the MoE ops, for tiny-deepseek)                                    ~57 MB
# Dropped: FlashAttention 2 (Hopper takes FA3), the Rust front end, qutlass, DeepGEMM, the
# sm100 FMHA. Here, with network for pip, from the repository root (~10 min, mostly xz):
#     bash tests/gpu/vllm_payload.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
out=.whl/vllm
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$out"
plat=()
for tag in manylinux_2_28 manylinux_2_17 manylinux2014 manylinux_2_26 manylinux_2_27 manylinux_2_31 manylinux1; do
    plat+=(--platform "${tag}_x86_64")
done
# The wheels vLLM imports on an eager engine's path that the GPU image lacks (xgrammar 0.2.7:
# later ones need a newer apache-tvm-ffi than vLLM pins); xxhash for kvray.
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${plat[@]}" -d "$work/w" \
    vllm==0.26.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
    cbor2==6.3.0 pyzmq==27.3.0 openai-harmony==0.0.8 openai==3.60.0 httpx2==2.16.2 httpcore2==2.16.2 \
    jiter==0.19.0 sniffio==1.3.1 distro==1.9.0 msgspec==0.23.0 pybase64==1.5.1 cachetools==8.0.2 \
    llguidance==1.7.6 xgrammar==0.2.7 apache-tvm-ffi==0.1.10 fastapi==0.136.3 starlette==1.10.0 \
    partial-json-parser==0.2.1.1.post7 setproctitle==1.3.8 xxhash

mkdir -p "$work/s" "$work/d" "$work/big/C" "$work/big/B" "$work/big/D" "$work/m"
unzip -q "$work"/w/vllm-0.26.0-*.whl -d "$work/s"
for wheel in "$work"/w/*.whl; do
    case $(basename "$wheel") in vllm-*) ;; *) unzip -q -o "$wheel" -d "$work/d" ;; esac
done
site=$work/s
rm -f "$site"/vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so "$site"/vllm/_qutlass_C*.so
rm -rf "$site"/vllm/vllm-rs "$site"/vllm/third_party/deep_gemm
find "$site" -path '*fmha_sm100*' -prune -exec rm -rf {} +
# The three large ops, each in a part of its own, at the same place under the site folder.
move() { mkdir -p "$(dirname "$work/big/$1/$2")"; mv "$site/$2" "$work/big/$1/$2"; }
move B vllm/_C_stable_libtorch.abi3.so
move C vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so
move D vllm/_moe_C_stable_libtorch.abi3.so
# SmolLM2 without its weights: what `kvray model tiny-*` builds from (kvray-build.json included).
smol=$(python3 -c 'from kvray.integrations.vllm.model import smollm2; print(smollm2())')
mkdir -p "$work/m/smollm2-135m-instruct"
find "$smol" -maxdepth 1 -type f ! -name '*.safetensors' -exec cp {} "$work/m/smollm2-135m-instruct/" \;

pack() { tar -C "$2" -cf - . | xz -9e -T0 > "$out/$1.tar.xz"; }
pack A "$site"
pack B "$work/big/B"
pack C "$work/big/C"
pack D "$work/big/D"
pack F "$work/d"
pack M "$work/m"
ls -l "$out"
du -cb "$out"/A.tar.xz "$out"/B.tar.xz | tail -1
du -cb "$out"/C.tar.xz "$out"/F.tar.xz "$out"/M.tar.xz "$out"/D.tar.xz | tail -1
