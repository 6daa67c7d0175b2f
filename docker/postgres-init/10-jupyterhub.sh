#!/bin/sh
# The hub's own role and database beside the broker's (run once, when the
# data volume is new): the hub's role owns only its database.
set -eu
psql -v ON_ERROR_STOP=1 --username "$POSTGRES_USER" --dbname "$POSTGRES_DB" \
  -v password="$JUPYTERHUB_DB_PASSWORD" <<'SQL'
CREATE ROLE jupyterhub LOGIN PASSWORD :'password';
CREATE DATABASE jupyterhub OWNER jupyterhub;
SQL
