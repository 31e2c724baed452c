"""Print the include directory CMake needs: `cuda` (cuda.h from the nvidia-cuda-runtime wheel) or `xla`
(jax.ffi.include_dir() of the installed jaxlib). Prints nothing if not found."""

import importlib.util
import os
import sys


def cuda_dir():
    # nvidia-cuda-runtime wheels: nvidia/cu13/include (CUDA 13) or nvidia/cuda_runtime/include (CUDA 12).
    spec = importlib.util.find_spec("nvidia")
    for root in list(spec.submodule_search_locations) if spec else []:
        for sub in ("cu13", "cuda_runtime", "cu12"):
            inc = os.path.join(root, sub, "include")
            if os.path.exists(os.path.join(inc, "cudaTypedefs.h")):
                return inc
    return ""


def xla_dir():
    spec = importlib.util.find_spec("jaxlib")
    if spec is None or not spec.submodule_search_locations:
        return ""
    inc = os.path.join(list(spec.submodule_search_locations)[0], "include")
    return inc if os.path.exists(os.path.join(inc, "xla", "ffi", "api", "ffi.h")) else ""


if __name__ == "__main__":
    print({"cuda": cuda_dir, "xla": xla_dir}[sys.argv[1]]())
