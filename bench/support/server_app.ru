# frozen_string_literal: true

# bench/server.rb's app (bench/support/server_app.rb) for the peer servers'
# own command lines (puma, falcon serve, thin). NB_BENCH_DB and
# NB_BENCH_DB_POOL choose how /pg reaches PostgreSQL.
require_relative "server_app"

run NeverBlockBench::ServerApp.new(db: ENV.fetch("NB_BENCH_DB", "threads"),
                                   db_pool: Integer(ENV.fetch("NB_BENCH_DB_POOL", "64")))
