# What commands run in Docker sandboxes (sandbox/docker_backend.py) see: a shell,
# coreutils, procps and Python. Nothing of AgentFlow is in it.
ARG BASE_IMAGE=debian:bookworm-slim
FROM ${BASE_IMAGE}
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        python3 procps \
    && rm -rf /var/lib/apt/lists/*
LABEL org.agentflow.image="sandbox-runtime"
