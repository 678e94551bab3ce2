# The stallfree engine: `stallfree serve` (OpenAI-compatible, chunked prefill, stall-free batching) on a GPU node.
#   docker build -f docker/engine.Dockerfile -t stallfree/engine:0.1.0 .
#
# Why this base and these pins:
# - The CUDA path compiles kernels on the node, at first use, and the engine does that during its warm-up,
#   before /ready turns 200 (the pod is not Ready until it can serve at speed). What each compile needs:
#   * the default attention backend (`auto` -> "triton" in bf16/fp16) and the fused layer kernels are the
#     project's Triton kernels. Triton ships its own ptxas, but builds a small C launcher per kernel with the
#     system C compiler against Python.h and links it with -lcuda: hence gcc, libc6-dev and python3-dev, and
#     TRITON_LIBCUDA_PATH at the toolkit's link stub (a GPU container gets the driver's libcuda.so.1 only, no
#     libcuda.so to link against; at run time the launcher loads the driver's libcuda.so.1 as usual).
#   * FlashInfer (`--attention-backend flashinfer`, optional: `auto` does not need it) JIT-compiles its paged
#     prefill/decode kernels with nvcc at first use, ~150 s per (dtype, head_dim) on 16 cores. A CUDA *runtime*
#     image has no nvcc, so the first request on such a pod failed: this is a *devel* image, nvcc included.
#     FLASHINFER_JIT_CACHE=1 also installs FlashInfer's precompiled kernels (flashinfer-jit-cache, from
#     FlashInfer's own index, one per CUDA version: cu128, cu129, cu130) so that nothing is compiled on the node.
# - torch's CUDA must be the toolkit's: nvcc builds FlashInfer's kernels against the same CUDA that torch and
#   Triton load. torch 2.11.0's Linux wheels are built for CUDA 13.0 (its default PyPI wheel requires
#   cuda-toolkit 13.0.2), so the base is CUDA 13.0.2; the build stops if the two disagree. CUDA 13 needs an
#   NVIDIA driver >= 580 on the node; for older drivers build with a CUDA 12.x pair, e.g.
#   --build-arg CUDA_VERSION=12.8.1 --build-arg TORCH_CUDA=cu128 (both must name the same major.minor).
# - Compiled kernels are cached in $HOME (~/.triton, ~/.cache/flashinfer): mount a volume there to keep them
#   across pod restarts.
ARG CUDA_VERSION=13.0.2
ARG UBUNTU_VERSION=ubuntu24.04
FROM nvidia/cuda:${CUDA_VERSION}-devel-${UBUNTU_VERSION}

# torch pinned with its CUDA variant; FlashInfer pinned to the release run with that torch on the H200 test
# machine (../shared/GPU.md).
ARG TORCH_VERSION=2.11.0
ARG TORCH_CUDA=cu130
ARG FLASHINFER_VERSION=0.6.13
ARG FLASHINFER_JIT_CACHE=0

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    VIRTUAL_ENV=/opt/stallfree \
    PATH=/opt/stallfree/bin:/usr/local/cuda/bin:$PATH \
    CUDA_HOME=/usr/local/cuda \
    TRITON_LIBCUDA_PATH=/usr/local/cuda/lib64/stubs

# gcc/g++/libc6-dev + python3-dev: Triton's launcher and FlashInfer's JIT (nvcc's host compiler) build on the node.
RUN apt-get update \
 && apt-get install -y --no-install-recommends \
      python3 python3-venv python3-pip python3-dev gcc g++ libc6-dev ca-certificates tini \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv "$VIRTUAL_ENV"

# torch first, the build of its CUDA variant from PyTorch's index (its dependencies, the matching Triton among
# them, from there or PyPI), then checked against nvcc.
RUN pip install --extra-index-url "https://download.pytorch.org/whl/${TORCH_CUDA}" \
      "torch==${TORCH_VERSION}+${TORCH_CUDA}" \
 && nvcc_cuda="$(nvcc --version | sed -n 's/.*release \([0-9]*\.[0-9]*\).*/\1/p')" \
 && torch_cuda="$(python -c 'import torch; print(torch.version.cuda)')" \
 && if [ "$nvcc_cuda" != "$torch_cuda" ]; then \
      echo "torch ${TORCH_VERSION}+${TORCH_CUDA} is built for CUDA ${torch_cuda}, the image's nvcc is ${nvcc_cuda}:" \
           "set CUDA_VERSION and TORCH_CUDA to the same major.minor" >&2; exit 1; fi

WORKDIR /src
# What docker/install.sh builds the wheel from (tests/test_packaging.py stages exactly these COPY lines).
COPY pyproject.toml setup.py README.md ./
COPY stallfree ./stallfree
COPY engine ./engine
COPY operator ./operator
COPY data/traces ./data/traces
COPY crds ./crds
COPY docker/install.sh docker/smoke.py ./docker/
# The project with the engine extra and FlashInfer, the bundled default model, then the smoke check (every
# engine module imports, `stallfree serve --help`): the same script the test suite runs.
RUN bash docker/install.sh engine /src "flashinfer-python==${FLASHINFER_VERSION}" \
 && if [ "${FLASHINFER_JIT_CACHE}" = "1" ]; then \
      pip install --no-deps --index-url "https://flashinfer.ai/whl/${TORCH_CUDA}" \
        "flashinfer-jit-cache==${FLASHINFER_VERSION}"; fi \
 # torch must still be the pinned build (nothing above may have replaced it).
 && python -c "import sys, torch; sys.exit(torch.__version__ != '${TORCH_VERSION}+${TORCH_CUDA}')" \
 && rm -rf /src

# Runs as the uid the operator's pod securityContext asks for (Ubuntu 24.04 images ship user "ubuntu" with it).
RUN (userdel --remove ubuntu 2>/dev/null || true) \
 && useradd --uid 1000 --create-home --shell /usr/sbin/nologin stallfree
USER 1000:1000
WORKDIR /home/stallfree

EXPOSE 8000
# tini forwards SIGTERM so the engine drains in-flight requests before it exits.
ENTRYPOINT ["/usr/bin/tini", "--"]
CMD ["stallfree", "serve", "--host", "0.0.0.0", "--port", "8000"]
