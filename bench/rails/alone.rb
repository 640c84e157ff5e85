# frozen_string_literal: true

# The benchmark app's GET /fast called in this process, with no HTTP server:
# the Rails and ActiveRecord work (and the query's client side) that any
# server adds its own to. bench/rails.rb runs it beside the servers of part
# (c), under the same Ruby, with neverblock_postgresql (NB_RAILS_ADAPTER).
#
#   ruby bench/rails/alone.rb REQUESTS CONCURRENCY
#
# CONCURRENCY NeverBlock tasks share REQUESTS calls of the app, as a
# NeverBlock server's requests would; each request's Rack env is a copy of
# one made before (a Hash#dup: far less than a server's parse). Prints one
# line: "seconds cpu_us allocations gc_us" per request (CPU: this
# process's, as /proc counts a server's).

require_relative "app"
require "rack/mock"

requests = Integer(ARGV.fetch(0))
concurrency = Integer(ARGV.fetch(1))
app = Rails.application

TEMPLATE = Rack::MockRequest.env_for("/fast").tap { |env| env.delete("rack.input") }.freeze # a GET: no body
call = lambda do |_|
  status, _headers, body = app.call(TEMPLATE.dup)
  body.close if body.respond_to?(:close)
  raise "GET /fast answered #{status}" unless status == 200
end

# @return [Array(Float, Float, Integer, Integer)] wall and CPU seconds, objects allocated, GC ms
run = lambda do |count|
  shares = (0...count).each_slice((count / concurrency.to_f).ceil).to_a
  GC.start
  allocated, gc_ms = GC.stat(:total_allocated_objects), GC.stat(:time) # rubocop:disable Style/ParallelAssignment
  cpu = Process.clock_gettime(Process::CLOCK_PROCESS_CPUTIME_ID)
  wall = Process.clock_gettime(Process::CLOCK_MONOTONIC)
  NeverBlock.run(stall_threshold: nil) do
    NeverBlock.wait_all(shares.map { |share| NeverBlock.spawn { share.each(&call) } })
  end
  [Process.clock_gettime(Process::CLOCK_MONOTONIC) - wall, Process.clock_gettime(Process::CLOCK_PROCESS_CPUTIME_ID) - cpu,
   GC.stat(:total_allocated_objects) - allocated, GC.stat(:time) - gc_ms]
end

# Warm-up: a pool connection per task opened (each costs milliseconds of
# SCRAM), the code paths run and compiled.
NeverBlock.run do
  NeverBlock.wait_all(Array.new(concurrency) do
    NeverBlock.spawn { ActiveRecord::Base.with_connection { |conn| conn.execute("select pg_sleep(0.02)").clear } }
  end)
end
run.call([concurrency * 2, 400].max)
seconds, cpu, allocated, gc_ms = run.call(requests)
puts format("%.6f %.3f %.2f %.3f", seconds, cpu / requests * 1e6, allocated.fdiv(requests), gc_ms * 1000.0 / requests)
