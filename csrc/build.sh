#!/usr/bin/env bash
# Build csrc/ into csrc/bin/libgrpo_kernels_sm90a.so on a machine without a GPU (csrc/README.md).
#
#   bash csrc/build.sh            toolchain (wheels) + compile + SASS report
#   bash csrc/build.sh --check    the same, then fail unless the fresh build's stamp equals the committed one's
#
# The toolchain comes from PyPI wheels, installed with pip into $GRPO_CSRC_TOOLCHAIN (default
# /tmp/grpo-csrc-toolchain; reused when its versions match): nvcc / ptxas / cicc / crt for CUDA 13.0 (the lent
# GPU's driver is CUDA 13.0: a 13.0 toolkit's SASS and static runtime run there), CCCL and the CUDA runtime
# headers with libcudart_static.a, CUTLASS 4.2.0's C++ headers, and cuobjdump + nvdisasm (13.2.86: the oldest
# published 13.x wheels of those two; they only read the binary). The host compiler is the system g++.
# The library exports a plain C ABI and links the CUDA runtime statically: no torch headers, no libcudart.so.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
TC="${GRPO_CSRC_TOOLCHAIN:-/tmp/grpo-csrc-toolchain}"
PY="${PYTHON:-python3}"
OUT="$HERE/bin"
LIB="$OUT/libgrpo_kernels_sm90a.so"

# pinned wheels (sizes measured 2026-11-28: nvcc 37.4 MB, nvvm 61.6 MB, crt 0.1 MB, cccl 3.1 MB, runtime 2.2 MB,
# cutlass 6.4 MB, cuobjdump 0.3 MB, nvdisasm 4.4 MB: 115 MB downloaded, 330 MB installed)
WHEELS=(
  "nvidia-cuda-nvcc==13.0.88"
  "nvidia-nvvm==13.0.88"
  "nvidia-cuda-crt==13.0.88"
  "nvidia-cuda-cccl==13.0.85"
  "nvidia-cuda-runtime==13.0.96"
  "nvidia-cutlass==4.2.0.0"
  "nvidia-cuda-cuobjdump==13.2.86"
  "nvidia-cuda-nvdisasm==13.2.86"
)
WANT="$(printf '%s\n' "${WHEELS[@]}")"
if [[ ! -f "$TC/.versions" || "$(cat "$TC/.versions")" != "$WANT" ]]; then
  rm -rf "$TC"
  t0=$(date +%s)
  # one pip call: --target replaces a top-level folder (nvidia/) that a second call would install again
  "$PY" -m pip install -q --no-deps --target "$TC" "${WHEELS[@]}"
  echo "$WANT" > "$TC/.versions"
  echo "toolchain: installed into $TC in $(( $(date +%s) - t0 )) s"
fi

CUDA="$TC/nvidia/cu13"
CUTLASS="$TC/cutlass_library/source"
export PATH="$CUDA/bin:$PATH"

# The stamp: sha256 of the sources and of this script (grpo_kernels/ops/lm_head/cutlass.py computes the same).
STAMP="$("$PY" "$HERE/stamp.py")"

mkdir -p "$OUT"
t0=$(date +%s)
# one object per kernel file, compiled side by side (each nvcc is one core for minutes), then one link
OBJ="$(mktemp -d)"
trap 'rm -rf "$OBJ"' EXIT
SOURCES=(lm_head_fwd_sm90 lm_head_bwd_sm90)
pids=()
for src in "${SOURCES[@]}"; do
  nvcc -std=c++17 -O3 -arch=sm_90a --expt-relaxed-constexpr -DNDEBUG "-DGRPO_CSRC_STAMP=\"$STAMP\"" \
    -I"$CUTLASS/include" -I"$CUTLASS/tools/util/include" \
    -Xptxas -v -Xcompiler -fPIC,-fvisibility=hidden -c -o "$OBJ/$src.o" "$HERE/$src.cu" 2> "$OBJ/$src.ptxas" &
  pids+=($!)
done
for i in "${!pids[@]}"; do
  wait "${pids[$i]}" || { cat "$OBJ/${SOURCES[$i]}.ptxas"; echo "compile of ${SOURCES[$i]}.cu failed"; exit 1; }
done
nvcc -arch=sm_90a -shared -cudart static -L"$CUDA/lib" -Xcompiler -fvisibility=hidden -o "$LIB.tmp" "$OBJ"/*.o
mv "$LIB.tmp" "$LIB"
for src in "${SOURCES[@]}"; do cat "$OBJ/$src.ptxas"; done > "$OUT/ptxas.txt"
strip --strip-unneeded "$LIB"
echo "compile: $(( $(date +%s) - t0 )) s, $(stat -c %s "$LIB") bytes -> ${LIB#"$HERE"/../}"
echo "$STAMP" > "$OUT/stamp.txt"

# SASS report for the tests (tests/test_csrc.py reads these two files; cuobjdump needs no GPU)
cuobjdump -sass "$LIB" > "$OUT/sass.txt"
cuobjdump -res-usage "$LIB" > "$OUT/res-usage.txt"
echo "sass: $(grep -c 'HGMMA' "$OUT/sass.txt") HGMMA, $(grep -c 'UTMALDG' "$OUT/sass.txt") UTMALDG lines"
gzip -9 -f "$OUT/sass.txt"

if [[ "${1:-}" == "--check" ]]; then
  committed="$(git -C "$HERE" show HEAD:csrc/bin/stamp.txt 2>/dev/null || true)"
  [[ "$committed" == "$STAMP" ]] || { echo "csrc/bin is stale: committed stamp '$committed', sources '$STAMP'"; exit 1; }
fi
