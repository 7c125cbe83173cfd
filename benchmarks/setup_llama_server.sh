#!/usr/bin/env bash
# Builds llama.cpp's `llama-server`, `llama-batched-bench`, `llama-quantize`, `llama-perplexity` and
# `llama-tokenize`, and the GGUF files that `tandem bench compare` (offline and --served) and
# `perplexity.py` run llama.cpp on: F32 and Q8_0 converted from the Hugging Face folder, Q4_0 and
# Q4_K quantized from the F32 one.
#
# The C++ sources come from the llama-cpp-python sdist on PyPI (it vendors llama.cpp under
# vendor/llama.cpp), so nothing but the Python package registry is needed. Nothing is installed
# system-wide: everything lands under $LLAMA_CPP_DIR (default ~/.cache/tandem/llama.cpp), and the
# GGUF files beside the Hugging Face folder made by `python -m tandem.bench.real_model`.
#
#   bash benchmarks/setup_llama_server.sh          # build, then the GGUF files
#   bash benchmarks/setup_llama_server.sh build    # only the binaries
#   bash benchmarks/setup_llama_server.sh gguf     # only the GGUF files (needs the binary's sources)
#   LLAMA_CPP_ISA=avx2 bash benchmarks/setup_llama_server.sh build   # into bin-avx2
#   LLAMA_CPP_ISA=avx512 bash benchmarks/setup_llama_server.sh build # into bin-avx512: no AMX
#
# LLAMA_CPP_ISA=avx2 builds for AVX2 and FMA only (an AMD Zen 3's instructions): beside
# TANDEM_CPU_ISA=avx2 it compares both engines' AVX2 paths on an AVX-512 machine.
# LLAMA_CPP_ISA=avx512 builds for AVX-512 with VNNI and BF16 but without AMX, into bin-avx512: on
# Sapphire Rapids the native build's AMX path segfaults in ggml_backend_amx_mul_mat
# (llama.cpp issue 20824) unless run with --no-repack, which also turns off its AVX-512 repacking.
#
# Every step is skipped when its output is already there, so running it again is cheap.
# The build takes minutes (about 7 on 2 cores); it runs under `nice` so the machine stays usable.
set -euo pipefail

STAGE="${1:-all}"
CACHE_DIR="${TANDEM_CACHE_DIR:-$HOME/.cache/tandem}"
LLAMA_CPP_DIR="${LLAMA_CPP_DIR:-$CACHE_DIR/llama.cpp}"
MODEL_DIR="${MODEL_DIR:-$CACHE_DIR/models/smollm2-135m-instruct}"
JOBS="${JOBS:-2}"
PYTHON="${PYTHON:-python}"
case "${LLAMA_CPP_ISA:-native}" in
    native) ISA_FLAGS=(-DGGML_NATIVE=ON); SUFFIX="" ;;
    avx2) ISA_FLAGS=(-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF)
          SUFFIX="-avx2" ;;
    avx512) ISA_FLAGS=(-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
                       -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON
                       -DGGML_AVX512_BF16=ON)
            SUFFIX="-avx512" ;;
    *) echo "LLAMA_CPP_ISA=$LLAMA_CPP_ISA: expected native, avx2 or avx512" >&2; exit 2 ;;
esac
BIN_DIR="$LLAMA_CPP_DIR/bin$SUFFIX"
BUILD_DIR="$LLAMA_CPP_DIR/build$SUFFIX"
SERVER_BIN="$BIN_DIR/llama-server"
TARGETS=(llama-server llama-batched-bench llama-quantize llama-perplexity llama-tokenize)
F32_GGUF="$MODEL_DIR-f32.gguf"
Q8_GGUF="$MODEL_DIR-q8_0.gguf"
Q4_0_GGUF="$MODEL_DIR-q4_0.gguf"
Q4_K_GGUF="$MODEL_DIR-q4_k.gguf"

log() { echo "[setup_llama_server] $*" >&2; }

# The unpacked sdist; downloaded once. Its vendor/llama.cpp holds the sources and converter.
fetch_sources() {
    local sdist
    sdist="$(ls "$LLAMA_CPP_DIR"/llama_cpp_python-*.tar.gz 2>/dev/null | head -n 1 || true)"
    if [[ -z "$sdist" ]]; then
        log "downloading the llama-cpp-python sdist"
        mkdir -p "$LLAMA_CPP_DIR"
        "$PYTHON" -m pip download --quiet --no-deps --no-binary :all: llama-cpp-python \
            -d "$LLAMA_CPP_DIR"
        sdist="$(ls "$LLAMA_CPP_DIR"/llama_cpp_python-*.tar.gz | head -n 1)"
    fi
    if [[ ! -f "$LLAMA_CPP_DIR/src/CMakeLists.txt" ]]; then
        log "unpacking $(basename "$sdist")"
        rm -rf "$LLAMA_CPP_DIR/src" "$LLAMA_CPP_DIR/unpack"
        mkdir -p "$LLAMA_CPP_DIR/unpack"
        tar -xzf "$sdist" -C "$LLAMA_CPP_DIR/unpack"
        mv "$LLAMA_CPP_DIR"/unpack/llama_cpp_python-*/vendor/llama.cpp "$LLAMA_CPP_DIR/src"
        rm -rf "$LLAMA_CPP_DIR/unpack"
    fi
    SRC_DIR="$LLAMA_CPP_DIR/src"
}

build_server() {
    local missing=()
    for target in "${TARGETS[@]}"; do [[ -x "$BIN_DIR/$target" ]] || missing+=("$target"); done
    if [[ ${#missing[@]} -eq 0 ]]; then
        log "already built: ${TARGETS[*]} in $BIN_DIR"
        return
    fi
    fetch_sources
    # Static libraries, so the one binary can be copied out of the build tree and still run.
    # No web UI (its prebuilt copy would be downloaded) and no OpenSSL (local HTTP only).
    log "configuring (Release, ${ISA_FLAGS[*]})"
    nice -n 10 cmake -S "$SRC_DIR" -B "$BUILD_DIR" \
        -DCMAKE_BUILD_TYPE=Release \
        "${ISA_FLAGS[@]}" \
        -DLLAMA_CURL=OFF \
        -DLLAMA_OPENSSL=OFF \
        -DLLAMA_BUILD_SERVER=ON \
        -DLLAMA_BUILD_UI=OFF \
        -DLLAMA_USE_PREBUILT_UI=OFF \
        -DLLAMA_BUILD_TESTS=OFF \
        -DLLAMA_BUILD_EXAMPLES=OFF \
        -DBUILD_SHARED_LIBS=OFF >&2
    log "building ${missing[*]} with $JOBS jobs"
    local start=$SECONDS
    nice -n 10 cmake --build "$BUILD_DIR" --config Release --target "${missing[@]}" \
        -j "$JOBS" >&2
    log "build took $((SECONDS - start)) s"
    mkdir -p "$BIN_DIR"
    for target in "${missing[@]}"; do cp "$BUILD_DIR/bin/$target" "$BIN_DIR/$target"; done
}

# The converter imports `gguf`; the sdist's own gguf-py matches it, whatever version is installed.
convert() {
    local outtype="$1" out="$2"
    if [[ -s "$out" ]]; then
        log "already converted: $out"
        return
    fi
    log "converting $MODEL_DIR to $outtype"
    PYTHONPATH="$SRC_DIR/gguf-py${PYTHONPATH:+:$PYTHONPATH}" nice -n 10 "$PYTHON" \
        "$SRC_DIR/convert_hf_to_gguf.py" "$MODEL_DIR" --outtype "$outtype" --outfile "$out.part" >&2
    mv "$out.part" "$out"
}

# --pure: every weight matrix in the one type (llama-quantize otherwise keeps some, such as the
# output and token-embedding matrices, in another), except where a matrix's rows do not divide
# into the type's blocks: SmolLM2's 576-wide rows are no multiple of Q4_K's 256, so those matrices
# fall back to Q5_0 and the Q4_K file is Q5_0 + Q4_K (only ffn_down, 1536 wide, is Q4_K).
quantize() {
    local type="$1" out="$2"
    if [[ -s "$out" ]]; then
        log "already quantized: $out"
        return
    fi
    log "quantizing $F32_GGUF to $type (--pure)"
    nice -n 10 "$BIN_DIR/llama-quantize" --pure "$F32_GGUF" "$out.part" "$type" "$JOBS" >&2
    mv "$out.part" "$out"
}

make_gguf() {
    fetch_sources
    "$PYTHON" -c "import sentencepiece" 2>/dev/null || "$PYTHON" -m pip install --quiet sentencepiece
    "$PYTHON" -m tandem.bench.real_model --output "$MODEL_DIR" >&2
    convert f32 "$F32_GGUF"
    convert q8_0 "$Q8_GGUF"
    [[ -x "$BIN_DIR/llama-quantize" ]] || build_server
    quantize Q4_0 "$Q4_0_GGUF"
    quantize Q4_K "$Q4_K_GGUF"
}

case "$STAGE" in
    build) build_server ;;
    gguf) make_gguf ;;
    all) build_server; make_gguf ;;
    *) echo "usage: $0 [all|build|gguf]" >&2; exit 2 ;;
esac

echo "binaries:     $BIN_DIR (${TARGETS[*]})"
if [[ "$STAGE" != build ]]; then
    echo "f32 gguf:     $F32_GGUF"
    echo "q8_0 gguf:    $Q8_GGUF"
    echo "q4_0 gguf:    $Q4_0_GGUF"
    echo "q4_k gguf:    $Q4_K_GGUF"
fi
