"""Print the requirements of a vLLM wheel that a CPU environment installs (used by build-vllm-env.sh).

    python compat/vllm_requirements.py WHEEL [--drop-cuda] [--extra REQ …]

Reads the wheel's ``Requires-Dist`` (no extras; markers evaluated for this interpreter), drops ``torch*`` (the
environment file pins torch) and, with ``--drop-cuda``, the CUDA-only packages of PyPI's CUDA ``vllm`` wheel
(vLLM's ``requirements/cuda.txt``: kernels and libraries that need an NVIDIA GPU), and prints one requirement a
line, then each ``--extra``.
"""

from __future__ import annotations

import argparse
import zipfile

from pip._vendor.packaging.requirements import Requirement

TORCH = {"torch", "torchvision", "torchaudio", "torchcodec"}
#: PyPI's CUDA ``vllm`` wheel's GPU-only requirements (vLLM 0.33/0.34 ``requirements/cuda.txt``)
CUDA_ONLY = {
    "pynvvideocodec",
    "flashinfer-python",
    "apache-tvm-ffi",
    "tilelang",
    "nvidia-cudnn-frontend",
    "nvtx",
    "fastsafetensors",
    "instanttensor",
    "nvidia-cutlass-dsl",
    "quack-kernels",
    "tokenspeed-mla",
    "humming-kernels",
}


def requirements(wheel: str, drop_cuda: bool) -> list[str]:
    """The wheel's requirements for a CPU environment (module docstring)."""
    with zipfile.ZipFile(wheel) as archive:
        meta = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        lines = archive.read(meta).decode().splitlines()
    drop = TORCH | (CUDA_ONLY if drop_cuda else set())
    out = []
    for line in lines:
        if not line.startswith("Requires-Dist:"):
            continue
        requirement = Requirement(line.split(":", 1)[1].strip())
        if requirement.name.lower().replace("_", "-") in drop:
            continue
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
            continue
        requirement.marker = None
        out.append(str(requirement))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("wheel")
    parser.add_argument("--drop-cuda", action="store_true")
    parser.add_argument("--extra", action="append", default=[])
    args = parser.parse_args()
    print("\n".join([*requirements(args.wheel, args.drop_cuda), *args.extra]))


if __name__ == "__main__":
    main()
