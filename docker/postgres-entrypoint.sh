#!/bin/sh
# First start: initdb into the volume with a password for TCP clients and the
# `agentflow` database. Every start: serve on 127.0.0.1:$POSTGRES_PORT only (the stack
# runs on host networking, so a wider address would be the host's).
set -eu
: "${POSTGRES_PORT:?}"
: "${POSTGRES_PASSWORD:?set POSTGRES_PASSWORD (see .env.example)}"
: "${POSTGRES_DB:=agentflow}"

mkdir -p "$PGDATA"
chown postgres:postgres "$PGDATA"
chmod 700 "$PGDATA"
as_postgres() { setpriv --reuid=postgres --regid=postgres --init-groups "$@"; }

if [ ! -s "$PGDATA/PG_VERSION" ]; then
    pwfile=$(mktemp)
    printf '%s\n' "$POSTGRES_PASSWORD" > "$pwfile"
    chown postgres "$pwfile"
    as_postgres initdb -D "$PGDATA" --username=postgres --pwfile="$pwfile" \
        --auth-local=trust --auth-host=scram-sha-256 --encoding=UTF8 --locale=C.UTF-8
    rm -f "$pwfile"
    echo "CREATE DATABASE \"$POSTGRES_DB\";" | as_postgres postgres --single -D "$PGDATA" postgres >/dev/null
fi

exec setpriv --reuid=postgres --regid=postgres --init-groups \
    postgres -D "$PGDATA" -c listen_addresses=127.0.0.1 -c port="$POSTGRES_PORT" \
    -c unix_socket_directories=/tmp
