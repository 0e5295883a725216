# The AgentFlow image: the gateway, the split trainer and the sandbox service.
#
# Built offline: `agentflow stack build` fills docker/wheels/ (deps/ and agentflow/)
# on the host, and nothing here reaches a package index. BASE_IMAGE is any Debian
# bookworm image (`agentflow stack build` makes one with debootstrap).
ARG BASE_IMAGE=debian:bookworm-slim
FROM ${BASE_IMAGE}

# bubblewrap: the sandbox service's default backend. tini reaps what the servers leave.
# chromium (and its headless shell): what browser envs and desktop envs (through their
# noVNC page) drive.
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        python3 python3-venv bubblewrap ca-certificates procps tini chromium chromium-headless-shell fonts-dejavu-core \
    && rm -rf /var/lib/apt/lists/*

RUN python3 -m venv /opt/agentflow
ENV PATH=/opt/agentflow/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HUB_OFFLINE=1

# Dependencies first, in their own layer: it is rebuilt only when they change, not on
# every change to AgentFlow itself.
COPY docker/wheels/deps/ /tmp/wheels/
RUN pip install --no-cache-dir --no-index /tmp/wheels/*.whl && rm -rf /tmp/wheels

COPY docker/wheels/agentflow/ /tmp/wheels/
RUN pip install --no-cache-dir --no-index --no-deps /tmp/wheels/*.whl \
    && rm -rf /tmp/wheels \
    && pip check

# The gateway and the trainer run as an unprivileged user; /data holds what they share
# (published weights, run directories), so disk weight sync sees the same paths.
RUN useradd --uid 10001 --create-home --shell /usr/sbin/nologin agentflow \
    && mkdir -p /data && chown agentflow:agentflow /data
COPY docker/healthcheck /usr/local/bin/agentflow-healthcheck
WORKDIR /data
ENTRYPOINT ["/usr/bin/tini", "--"]
CMD ["agentflow", "--help"]
LABEL org.agentflow.image="agentflow"
