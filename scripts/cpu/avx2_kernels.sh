#!/usr/bin/env bash
# Run a command with the kernels an AVX2 CPU gets (no AVX-512, AVX-VNNI or AMX), at this machine's native speed:
#   scripts/cpu/avx2_kernels.sh COMMAND [ARGS...]
# e.g.  scripts/cpu/avx2_kernels.sh python -m pytest -n 0 tests/runtime/test_pooled.py -k int4
#       scripts/cpu/avx2_kernels.sh python benchmarks/cpu_step_ablation.py T --gguf G --llama L ...
# Builds scripts/cpu/avx2_cpuid.c (gcc) into a temporary folder and preloads it: CPUID answers without the AVX-512,
# AVX-VNNI and AMX bits, so onnxruntime's MLAS, glibc and llama.cpp's CPU backend choose their AVX2 code (the
# exactness probe then finds what it finds on an AMD EPYC with AVX2: block 32 at level 4 paired, block 16 as it is).
# The code that runs is an AVX2 machine's; the cores, caches and memory are this one's, so timings are not an AVX2
# machine's. Needs Linux on a CPU with CPUID faulting (`cpuid_fault` in /proc/cpuinfo) and gcc; refuses otherwise.
# Bits under it are the bits of that code on any x86-64 CPU; qemu (`qemu-x86_64 -cpu Haswell`) checks the same code
# with the instructions emulated, slowly.
set -euo pipefail
[ $# -gt 0 ] || { echo "usage: $0 COMMAND [ARGS...]" >&2; exit 2; }
grep -qw cpuid_fault /proc/cpuinfo || { echo "$0: this CPU or kernel has no CPUID faulting (cpuid_fault)" >&2; exit 2; }
command -v gcc >/dev/null || { echo "$0: needs gcc to build scripts/cpu/avx2_cpuid.c" >&2; exit 2; }
here=$(cd "$(dirname "$0")" && pwd)
lib=$(mktemp -d)/avx2_cpuid.so
trap 'rm -rf "$(dirname "$lib")"' EXIT
gcc -O2 -shared -fPIC -o "$lib" "$here/avx2_cpuid.c" -ldl
LD_PRELOAD="$lib${LD_PRELOAD:+:$LD_PRELOAD}" "$@"
