# PostgreSQL for the compose stack (no image registry is needed: Debian's package on the
# same base as the other images).
ARG BASE_IMAGE=debian:bookworm-slim
FROM ${BASE_IMAGE}
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        postgresql-15 \
    && rm -rf /var/lib/apt/lists/*
COPY docker/postgres-entrypoint.sh /usr/local/bin/postgres-entrypoint
ENV PATH=/usr/lib/postgresql/15/bin:$PATH \
    PGDATA=/var/lib/agentflow-postgres/data
STOPSIGNAL SIGINT
ENTRYPOINT ["/usr/local/bin/postgres-entrypoint"]
LABEL org.agentflow.image="postgres"
