# frozen_string_literal: true

# Serves a config.ru with NeverBlock::Server in this one process (workers: 0,
# no master), for bench/server.rb and bench/rails.rb:
#
#   bundle exec ruby bench/support/neverblock_server.rb CONFIG_RU PORT [FIBER_POOL]
#
# Listens on 127.0.0.1:PORT; stops on SIGTERM or SIGINT (in-flight requests
# finish first).
#
# With NB_BENCH_GC_SOCKET=PATH it also answers, on a Unix socket at PATH,
# this process's allocation count (see bench/support/gc_probe.rb), from a
# thread of its own that blocks in accept: the requests' path stays as
# users run it, with nothing added to it.

$LOAD_PATH.unshift(File.expand_path("../../lib", __dir__))
require "rack"
require "neverblock/server"

config, port, fiber_pool = ARGV
abort "usage: #{$PROGRAM_NAME} CONFIG_RU PORT [FIBER_POOL]" unless config && port

if (gc_socket = ENV.fetch("NB_BENCH_GC_SOCKET", nil))
  require_relative "servers"
  NeverBlockBench::GcProbe.serve(gc_socket)
end

app = Rack::Builder.parse_file(File.expand_path(config))
app = app.first if app.is_a?(Array) # rack 2 returned [app, options]
server = NeverBlock::Server.new(app, bind: ["tcp://127.0.0.1:#{Integer(port)}"], workers: 0,
                                     fiber_pool: Integer(fiber_pool || 1000))
%w[TERM INT].each { |signal| trap(signal) { server.stop } }
warn "NeverBlock #{NeverBlock::VERSION} serving #{config} on 127.0.0.1:#{port} " \
     "(pid #{Process.pid}, fiber_pool #{fiber_pool || 1000}, selector #{ENV.fetch('NEVERBLOCK_SELECTOR', 'default')})"
server.run
