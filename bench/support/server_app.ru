# frozen_string_literal: true

# bench/server.rb's app (bench/support/server_app.rb) for the peer servers'
# command lines. NB_BENCH_DB and NB_BENCH_DB_POOL choose how /pg reaches
# PostgreSQL; NB_BENCH_GC_SOCKET starts a GcProbe.
require_relative "server_app"

NeverBlockBench::GcProbe.serve(ENV["NB_BENCH_GC_SOCKET"]) if ENV["NB_BENCH_GC_SOCKET"]

run NeverBlockBench::ServerApp.new(db: ENV.fetch("NB_BENCH_DB", "threads"),
                                   db_pool: Integer(ENV.fetch("NB_BENCH_DB_POOL", "64")))
