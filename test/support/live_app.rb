# frozen_string_literal: true

require_relative "serve_processes"

# `neverblock serve` of the Rails app with Live actions in
# test/fixtures/server/live_app, and streams opened on it.
module LiveApp
  include ServeProcesses

  FIXTURE = File.expand_path("../fixtures/server/live_app", __dir__)

  # `quiet`: Rails logs warnings only (the test does not read the log).
  def serve_live(*args, quiet: false)
    env = { "RAILS_ENV" => "production", "LIVE_LOG_LEVEL" => quiet ? "warn" : "info" }
    serve("config.ru", "-E", "production", "-w", "0", *args, env: env, chdir: FIXTURE, timeout: 60)
  end

  # A connection that has sent `GET path`.
  def open_stream(server, path)
    socket = TCPSocket.new("127.0.0.1", server[:port])
    socket.write("GET #{path} HTTP/1.1\r\nHost: localhost\r\n\r\n")
    socket
  end
end
