# frozen_string_literal: true

# GET /slow?seconds=1: one query that takes `seconds` (at most 10) in
# PostgreSQL, `select pg_sleep(...)`, on this request's own connection.
# While it waits, the worker serves other requests: ten at once take about
# one second, not ten. The answer says which worker process and which
# PostgreSQL backend served it, and the pool's size.
class SlowController < ApplicationController
  def show
    seconds = Float(params.fetch(:seconds, 1), exception: false)
    return render(json: { error: "seconds must be a number" }, status: :bad_request) unless seconds&.finite?

    seconds = seconds.clamp(0.0, 10.0)
    started = Process.clock_gettime(Process::CLOCK_MONOTONIC)
    backend = ActiveRecord::Base.with_connection do |connection|
      connection.select_value("SELECT pg_backend_pid() FROM pg_sleep(#{seconds})")
    end
    render json: { slept: seconds, seconds: (Process.clock_gettime(Process::CLOCK_MONOTONIC) - started).round(3),
                   worker_pid: Process.pid, backend_pid: backend,
                   pool_size: ActiveRecord::Base.connection_pool.size }
  end
end
