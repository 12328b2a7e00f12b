#!/usr/bin/env python3
"""Builds kernels/copy.ptx from kernels/copy.cu with NVRTC (no GPU needed).

Use NVRTC 13.0 so that the PTX ISA version (9.0) loads on driver 580 (CUDA 13.0) and later:
    pip download --no-deps "nvidia-cuda-nvrtc==13.0.*" -d /tmp/nvrtc && unzip it,
    then: python kernels/build_ptx.py /path/to/libnvrtc.so.13
On the GPU machine `nvcc -ptx -arch=compute_75 kernels/copy.cu` gives equivalent PTX.
"""

import ctypes
import pathlib
import sys

here = pathlib.Path(__file__).resolve().parent
lib = ctypes.CDLL(sys.argv[1] if len(sys.argv) > 1 else "libnvrtc.so.13")
src = (here / "copy.cu").read_bytes()
prog = ctypes.c_void_p()


def check(rc: int, what: str) -> None:
    if rc != 0:
        raise SystemExit(f"{what} failed with NVRTC error {rc}")


check(lib.nvrtcCreateProgram(ctypes.byref(prog), src, b"copy.cu", 0, None, None), "nvrtcCreateProgram")
opts = [b"--gpu-architecture=compute_75", b"-default-device", b"--use_fast_math", b"-std=c++17"]
arr = (ctypes.c_char_p * len(opts))(*opts)
rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
size = ctypes.c_size_t()
lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
log = ctypes.create_string_buffer(size.value)
lib.nvrtcGetProgramLog(prog, log)
if log.value.strip():
    print(log.value.decode(), file=sys.stderr)
check(rc, "nvrtcCompileProgram")
lib.nvrtcGetPTXSize(prog, ctypes.byref(size))
ptx = ctypes.create_string_buffer(size.value)
check(lib.nvrtcGetPTX(prog, ptx), "nvrtcGetPTX")
(here / "copy.ptx").write_bytes(ptx.value)
print(f"wrote {here / 'copy.ptx'} ({len(ptx.value)} bytes)")
