"""Shrink onnxruntime-gpu's CUDA provider for one GPU architecture, so the package fits a size-limited transfer.

    python scripts/gpu/ort_sm90.py SITE/onnxruntime/capi/libonnxruntime_providers_cuda.so [--arch 90]

The provider carries its kernels as CUDA fat binaries (ELF section .nv_fatbin): containers of one machine-code
image per architecture (onnxruntime-gpu 1.31.1: sm_75, 80, 86, 89, 90, 120; 218 of its 284 MB). The CUDA runtime
loads, for each container, the image of the device's architecture and never reads the others, so zeroing those
others, headers kept, leaves a library that runs on that architecture and compresses to far less (the whole package
as tar.xz: 203 MB -> 62 MB without them and without libonnxruntime.so, which the Python module does not load).
Containers without an image of the architecture are left whole. Rewrites the file in place; prints what it zeroed.
Used by scripts/gpu/h200_payload.sh; scripts/gpu/h200_block.sh checks the result by running a CUDA session before using it.
"""

from __future__ import annotations

import argparse
import struct
import subprocess
import sys

FATBIN_MAGIC = 0xBA55ED50


def fatbin_section(path: str) -> tuple[int, int]:
    """(file offset, size) of .nv_fatbin, from readelf."""
    out = subprocess.run(["readelf", "-S", "-W", path], capture_output=True, text=True, check=True).stdout
    for line in out.splitlines():
        if ".nv_fatbin" in line:
            fields = line.split("]", 1)[1].split()
            return int(fields[3], 16), int(fields[4], 16)
    raise SystemExit(f"{path} has no .nv_fatbin section")


def entries(data: bytearray, start: int, end: int):
    """Each container's images: lists of (payload offset, payload size, arch)."""
    pos = start
    while pos < end:
        magic, _, header, size = struct.unpack_from("<IHHQ", data, pos)
        if magic != FATBIN_MAGIC:  # containers are 8-byte aligned; padding between them
            pos += 8
            continue
        images, e, stop = [], pos + header, pos + header + size
        while e < stop:
            _kind, _ver, eheader, payload = struct.unpack_from("<HHIQ", data, e)
            arch = struct.unpack_from("<I", data, e + 28)[0]
            images.append((e + eheader, payload, arch))
            e += eheader + payload
        yield images
        pos = stop


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("library")
    p.add_argument("--arch", type=int, default=90)
    a = p.parse_args(argv)
    with open(a.library, "rb") as f:
        data = bytearray(f.read())
    offset, size = fatbin_section(a.library)
    zeroed = kept = whole = 0
    for images in entries(data, offset, offset + size):
        if not any(arch == a.arch for *_, arch in images):
            whole += 1
            continue
        for at, n, arch in images:
            if arch == a.arch:
                kept += n
            else:
                data[at:at + n] = bytes(n)
                zeroed += n
    with open(a.library, "wb") as f:
        f.write(data)
    print(f"zeroed {zeroed / 1e6:.1f} MB of other architectures' images, kept {kept / 1e6:.1f} MB of sm_{a.arch}; "
          f"{whole} containers without sm_{a.arch} left whole")
    return 0


if __name__ == "__main__":
    sys.exit(main())
