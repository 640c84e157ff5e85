# frozen_string_literal: true

module NeverBlock
  class Server
    # Cancels the requests whose client hung up while the app ran (a
    # balancer's timeout, a closed tab, a retry storm), as Go's net/http
    # cancels a request's context: the request's fiber gets {HungUp} at its
    # current wait, and with it what it spawned (Task::Tree), so a query it
    # waits on is cancelled on the database server by the pool's recovery.
    # The access log shows 499 (nginx's "client closed request") and
    # /metrics counts it (`neverblock_client_hangups_total`).
    #
    # How it sees a hang-up without a cost per request: a connection is on
    # its list only while the app handles its request (whose body has been
    # read by then) and while a streamed response's body is written
    # ({StreamedResponse}: a body waiting between chunks is cancelled at
    # that wait, not at its next write), and every INTERVAL seconds it
    # peeks, without reading, at those that have been there since the last
    # look: end of file or a reset is a hang-up; bytes (a pipelined next
    # request) or nothing to read is a client still there. A request that takes less than
    # INTERVAL is never looked at; one that outlives its client is
    # cancelled within about 2 × INTERVAL.
    #
    # A client that half-closes its side after sending the request (shutdown
    # SHUT_WR) looks the same as one that closed: TCP tells the two apart
    # only when the response is written. Like Go and nginx, it counts as a
    # hang-up; no browser, proxy or common HTTP client half-closes.
    #
    # TLS: a client that sends close_notify before closing shows bytes, not
    # the end of the stream, and is only noticed when its response is
    # written; one that just closes is seen as with plain TCP.
    #
    # Who calls it: Exchange#call_and_write (#watch, #unwatch, around the app's
    # call), StreamedResponse#write_body (around a streamed body's writing),
    # the server's serving tasks (#run). Loop's thread only.
    class HangupWatch
      # Seconds between looks.
      INTERVAL = 0.5

      # Connections peeked in one turn of the loop: a peek is a system call
      # (a few microseconds), and a look at thousands of open streams must
      # not hold the loop for all of them at once.
      SLICE = 128

      # Raised in a request's fiber whose client hung up.
      class HungUp < Cancelled
        def initialize(message = "the client closed the connection while the app handled its request")
          super
        end
      end

      def initialize
        @watched = {}.compare_by_identity # connection => the look it was added before
        @looks = 0
      end

      # The app is about to handle the connection's request, or its
      # streamed body is about to be written.
      # @param connection [Connection]
      # @return [void]
      def watch(connection)
        @watched[connection] = @looks
      end

      # The app has returned (or raised), or the body is written.
      # @return [void]
      def unwatch(connection)
        @watched.delete(connection)
      end

      # @return [Integer] connections whose request the app handles now.
      def size
        @watched.size
      end

      # Looks every INTERVAL seconds until the task is cancelled.
      # @return [void]
      def run
        loop do
          sleep INTERVAL
          look
        end
      end

      # One look: cancels the requests of connections whose client is gone,
      # SLICE connections a turn of the loop (from its task only).
      # @return [Integer] how many it cancelled.
      def look
        looks = @looks
        @looks += 1
        gone = 0
        @watched.keys.each_slice(SLICE).with_index do |slice, index|
          Fiber.scheduler.yield if index.positive?
          slice.each do |connection|
            since = @watched[connection] # nil once unwatched, newer once watched again meanwhile
            next unless since && since < looks && connection.client_gone?

            @watched.delete(connection)
            connection.cancel_for_hangup
            gone += 1
          end
        end
        gone
      end
    end
  end
end
