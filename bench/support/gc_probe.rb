# frozen_string_literal: true

require "socket"

module NeverBlockBench
  # How many objects a server process allocated, asked from outside it:
  # the server side ({.serve}) answers each connection to a Unix socket
  # with `GC.stat(:total_allocated_objects)` and closes it; the benchmark
  # ({.read}) reads that before and after a measured run, and divides the
  # difference by the requests answered.
  #
  # The answering thread blocks in accept (no GVL held), so the server's
  # requests run exactly as without it. Each query allocates a few objects
  # of its own, which are lost in the hundreds of thousands of requests
  # between two reads.
  module GcProbe
    module_function

    # Starts the answering thread (server side).
    # @param path [String] where the Unix socket is created
    # @return [Thread]
    def serve(path)
      listener = UNIXServer.new(path)
      Thread.new do
        loop do
          client = listener.accept
          client.write("#{GC.stat(:total_allocated_objects)}\n")
          client.close
        end
      end
    end

    # @param path [String] the server's socket
    # @return [Integer, nil] objects the server has allocated so far; nil
    #   when it does not answer
    def read(path)
      UNIXSocket.open(path) { |socket| Integer(socket.read, exception: false) }
    rescue SystemCallError
      nil
    end
  end
end
