# frozen_string_literal: true

module NeverBlock
  class Debouncer
    # One upstream call: runs the app for a key in a task (inside a NeverBlock
    # loop) or a thread (anywhere else) that belongs to the debouncer, not to
    # the leader's request. Cancelling or killing the leader's request
    # therefore does not abort the call: the followers still get the answer.
    #
    # The call completes the store's lease exactly once, whatever happens,
    # and hands the leader its own response through a one-message queue:
    # `[:response, status, headers, body]` or `[:error, exception]`.
    class UpstreamCall
      # Chunks of an oversized body buffered for the leader before the
      # upstream waits for it to read: backpressure.
      STREAM_DEPTH = 16

      # @param app [#call] the Rack app.
      # @param env [Hash] the leader's env (the app sees the leader's request).
      # @param store [#complete] the store that granted `lease`.
      # @param lease [Object]
      # @param ttl [Numeric] the debouncer's ttl, seconds.
      # @param stale [Numeric] seconds a stored response is served stale after its ttl.
      # @param max_body [Integer] bytes.
      def initialize(app, env, store, lease, ttl:, max_body:, stale: 0)
        @app = app
        @env = env
        @store = store
        @lease = lease
        @ttl = ttl
        @stale = stale
        @max_body = max_body
        @handoff = Thread::Queue.new
        @completed = false
      end

      # Starts the call in its own task or thread.
      # @return [self]
      # @raise [StandardError] when no task or thread can be started (the
      #   followers then get 502 rather than wait on a call that never ran).
      def start
        if NeverBlock.neverblocking?
          task = NeverBlock.spawn(detached: true, internal: true) { run } # it answers the followers too
          task.value if task.status == :failed && !@completed # no fiber for it (raises why)
        else
          Thread.new { run }.report_on_exception = false
        end
        self
      rescue StandardError
        complete(Outcome::Failure.new(502, "Bad Gateway: the upstream call could not start"))
        raise
      end

      # Waits (this fiber or thread only) for the leader's response.
      # @return [Array] `[:response, status, headers, body]` or `[:error, exception]`.
      def result
        message = @handoff.pop
        @handoff.close
        message
      end

      # The leader stopped waiting (its request was cancelled): a response
      # handed over for it alone is closed, and an oversized body stops
      # streaming. The followers are not affected.
      # @return [void]
      def abandon
        @handoff.close
        while (message = (@handoff.pop(true) rescue nil)) # rubocop:disable Style/RescueModifier -- ThreadError: empty
          message[3].close if message[0] == :response && message[3].respond_to?(:close)
        end
      end

      private

      def run
        status, headers, body = @app.call(@env)
        deliver(status, headers, body)
      rescue Exception => e # rubocop:disable Lint/RescueException -- followers must never wait on a dead call
        complete(Outcome::Failure.new(502, "Bad Gateway: the upstream call failed"))
        hand_over([:error, e])
        raise unless e.is_a?(StandardError)
      ensure
        complete(Outcome::Failure.new(502, "Bad Gateway: the upstream call ended without a response"))
      end

      def deliver(status, headers, body)
        ttl = CachePolicy.decide(status, headers, @ttl)
        if ttl == :private || !(body.respond_to?(:to_ary) || body.respond_to?(:each))
          # Only the leader may see it, or it is a streaming body (call(stream)) that cannot be buffered.
          complete(Outcome::PASS)
          hand_over([:response, status, headers, body])
        elsif too_long?(headers)
          # Announced larger than can be shared: streams to the leader from its first byte, buffered nowhere.
          complete(Outcome::PASS)
          hand_over([:response, status, headers, body])
        elsif body.respond_to?(:to_ary)
          chunks = body.to_ary # closes the body (Rack SPEC)
          if chunks.sum(&:bytesize) > @max_body
            complete(Outcome::PASS)
            hand_over([:response, status, headers, chunks])
          else
            share(status, headers, bytes(chunks), ttl)
          end
        else
          buffer_or_stream(status, headers, body, ttl)
        end
      end

      # @return [Boolean] whether the response's Content-Length is over max_body.
      def too_long?(headers)
        length = headers["content-length"] || headers["Content-Length"]
        !length.nil? && length.to_s.to_i > @max_body
      end

      # Buffers an `each` body up to max_body and shares it; past max_body the
      # followers go upstream themselves, and the body streams to the leader.
      def buffer_or_stream(status, headers, body, ttl)
        buffer = []
        size = 0
        stream = nil
        body.each do |chunk|
          if stream
            stream.push(chunk)
          elsif (size += chunk.bytesize) > @max_body
            complete(Outcome::PASS)
            stream = Thread::SizedQueue.new(STREAM_DEPTH)
            return unless hand_over([:response, status, headers, StreamBody.new(buffer, stream)])

            stream.push(chunk)
          else
            buffer << chunk
          end
        end
        stream ? stream.close : share(status, headers, bytes(buffer), ttl)
      rescue ClosedQueueError
        # The leader closed the body (its client went away): stop reading upstream.
      rescue StandardError => e
        raise unless stream

        stream.push(e) rescue nil # rubocop:disable Style/RescueModifier -- the leader may be gone
        stream.close
      ensure
        body.close if body.respond_to?(:close)
      end

      # Chunks of different encodings (a UTF-8 String and a binary one) cannot
      # be joined as text; the body is bytes anyway.
      def bytes(chunks)
        chunks.each_with_object(String.new(encoding: Encoding::BINARY)) { |chunk, body| body << chunk.b }
      end

      def share(status, headers, body, ttl)
        names = CachePolicy.vary(headers)
        response = Outcome::Response.new(status, headers, body, vary: (Key.values(names, @env) unless names.empty?))
        complete(response, ttl)
        hand_over([:response, *response.to_rack(ROLE_LEADER)])
      end

      # A store that fails here (Redis down) must not leave the leader
      # waiting: the error is logged, and a shared store's followers take
      # over once the lease expires.
      def complete(outcome, ttl = 0)
        return if @completed

        @completed = true
        @store.complete(@lease, outcome, ttl, ttl.positive? ? @stale : 0)
      rescue StandardError => e
        NeverBlock.logger.error("NeverBlock::Debouncer: the store failed to complete a call: #{e.class}: #{e.message}")
      end

      # @return [Boolean] false when the leader is gone (the response was closed).
      def hand_over(message)
        @handoff.push(message)
        true
      rescue ClosedQueueError
        message[3].close if message[0] == :response && message[3].respond_to?(:close)
        false
      end

      # The body of an oversized response, for the leader: what was buffered,
      # then the rest as the upstream call reads it.
      class StreamBody
        # @param buffered [Array<String>]
        # @param queue [Thread::SizedQueue] chunks; an Exception to re-raise;
        #   closed at the end.
        def initialize(buffered, queue)
          @buffered = buffered
          @queue = queue
        end

        # @yieldparam chunk [String]
        # @return [void]
        def each
          @buffered.each { |chunk| yield chunk }
          @buffered = []
          while (chunk = @queue.pop)
            raise chunk if chunk.is_a?(Exception)

            yield chunk
          end
        end

        # Stops the upstream read if it is still going.
        # @return [void]
        def close
          @queue.close
          @queue.clear
        end
      end
    end
  end
end
