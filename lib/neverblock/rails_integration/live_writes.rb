# frozen_string_literal: true

module NeverBlock
  module RailsIntegration
    # An ActionController::Live stream on NeverBlock's loop writes each chunk
    # to its client from the action's own fiber.
    #
    # Rails hands a Live action's chunks to the server through a queue:
    # `response.stream.write` pushes the chunk, and the server's fiber, which
    # waits on that queue in the body's `each`, is woken, pops it and writes
    # it. On a thread per stream that is how a chunk crosses threads; on one
    # loop it costs every event a wake-up and a switch to a second fiber, a
    # tenth of the CPU of an event at thousands of streams. Here, once the
    # server is in the body's `each` and nothing is queued, a write goes
    # straight to the server's own writing of the body (chunked framing,
    # `write_timeout`, the bytes counted), from the writing fiber, and
    # returns once the socket took the chunk.
    #
    # What stays Rails': the chunk is queued as before while the server has
    # not reached the body yet (a write before the action returned its
    # headers), while chunks queued before are still being written (they go
    # first), and when the writer is not one of the request's own tasks (a
    # thread the action started, another request broadcasting to this
    # stream, which must not wait on this client); Rails' `write` around it
    # (the commit of the headers, `ClientDisconnected`, `ignore_disconnect`)
    # runs unchanged. Writers are serialised, so that two fibers writing at
    # once cannot interleave two chunks' bytes, and the body's end waits for
    # a write under way. Back-pressure is the socket's: a writer waits while
    # the client does not read, where Rails' queue held ten chunks before it
    # made the writer wait.
    #
    # A direct write that fails ends the stream as the server's own write
    # would: the stream is aborted, so that Rails' `write` raises
    # ActionController::Live::ClientDisconnected in the action (or drops
    # what follows, under `ignore_disconnect`), and the server's fiber gets
    # the error: the client gone or not reading (logged 499, or its status
    # at `write_timeout`), or what a middleware's body raised (logged as the
    # app's error). When the writing fiber itself is interrupted part-way
    # through a chunk (its task cancelled, a timeout around the write), the
    # interruption is raised in it, and the server's fiber gets a
    # {WriteInterrupted}: the chunk was cut, so the connection closes.
    module LiveWrites
      # A direct write stopped part-way through a chunk by its own fiber's
      # interruption (a cancel, a timeout around the write): the response
      # is cut, so the server's writing of the body ends with this (the
      # interruption is its `cause`) and the connection closes.
      class WriteInterrupted < NeverBlock::BaseError
      end

      # Gives `stream` (an ActionController::Live::Buffer with nothing
      # written yet) a {Queue} whose writes from `owner`'s tasks go
      # straight to the client. Called by {Live} for an action it runs on
      # the loop; a stream whose queue is not Rails' bounded one (a
      # `queue_size` of nil) is left as it is.
      # @param stream [ActionController::Live::Buffer]
      # @param owner [Task] the request's task.
      # @return [void]
      def self.enable(stream, owner)
        stream.__send__(:neverblock_write_directly, owner) if owner && stream.respond_to?(:neverblock_write_directly, true)
      end

      # Rails' Live::Buffer queue, taking writes straight to the server
      # while the server waits in the body's `each`.
      class Queue < Thread::SizedQueue
        # @param max [Integer] Rails' queue size.
        # @param owner [Task] the request's task: only its tasks write
        #   directly (another request's fiber broadcasting to this stream
        #   must not wait on this client, nor cut its chunk if cancelled).
        # @param on_failure [#call] called when a direct write failed (the
        #   buffer's `abort`).
        def initialize(max, owner, on_failure)
          super(max)
          @owner = owner
          @on_failure = on_failure
          @lock = Thread::Mutex.new
          @sink = nil
          @thread = nil
          @writer = nil # the last task found to be one of the owner's (own_task?)
          @failure = nil
          @popped = 0 # chunks the server took from the queue and has not written yet
        end

        # Rails' `@buf.push`: straight to the server when it is taking
        # writes, else onto the queue (as is Rails 7.2's end of the stream,
        # a nil); dropped once a direct write failed (Rails' `write` then
        # raises ClientDisconnected, or drops it too under
        # `ignore_disconnect`).
        #
        # (Rails' `non_block` and Ruby 3.2's `timeout:` are named rather than
        # splatted: a splat made an Array and a Hash for every chunk.)
        def push(chunk, non_block = false, timeout: nil)
          return self if @failure
          if chunk && @sink && own_task?
            # (checked under the lock: the server may have stopped taking
            # writes, or taken a queued chunk, while this fiber waited; no
            # `return` from the block, which would allocate a throw for
            # every chunk)
            written = @lock.synchronize { write_through(chunk) if direct? }
            return self if written || @failure # (@failure: another writer's write failed meanwhile)
          end
          timeout.nil? ? super(chunk, non_block) : super
        rescue ClosedQueueError
          # A failure closed the queue while this push waited for room (Rails
          # 7.2 never closes it, and its write would not expect this).
          raise unless @failure

          self
        end
        alias << push
        alias enq push

        # Rails' each_chunk takes chunks with this (the server's fiber).
        def pop(non_block = false, timeout: nil)
          chunk = timeout.nil? ? super(non_block) : super
          @popped += 1 if chunk
          chunk
        end
        alias shift pop
        alias deq pop

        # Runs the block (the server's fiber, inside the body's `each`),
        # taking direct writes to `sink` meanwhile. The block's argument
        # writes a chunk that was queued, under the writers' lock. Returns
        # once no direct write is under way, so that the end of the body
        # never lands inside a chunk.
        # @param sink [Proc] the server's block for each chunk.
        # @raise [Exception] what a direct write failed with.
        def deliver(sink)
          @thread = Thread.current
          @sink = sink
          yield(lambda do |chunk|
            @lock.synchronize do
              raise @failure if @failure

              begin
                sink.call(chunk)
              ensure
                @popped -= 1
              end
            end
          end)
          @lock.synchronize { @sink = nil }
          raise @failure if @failure
        ensure
          @sink = nil
        end

        private

        # Whether the server takes this chunk straight away (under the
        # writers' lock, from one of the request's own tasks).
        def direct?
          @sink && @popped.zero? && empty? && !closed? && Thread.current.equal?(@thread)
        end

        # Whether the current task is the request's or one of its
        # descendants. The last one found is remembered: a stream's writes
        # come from its action's task, which stays the request's while the
        # request runs (a task its cancelled parent abandoned would too,
        # though detached: it is still the request's work).
        def own_task?
          current = Task.current
          return true if current && current.equal?(@writer)

          task = current
          task = task.parent while task && !task.equal?(@owner)
          @writer = current if task
          !task.nil?
        end

        # The server's block for the chunk, in this fiber. If it fails, the
        # stream ends: the buffer is aborted (Rails' `write` then raises
        # ClientDisconnected in the action, or drops what follows under
        # `ignore_disconnect`) and the server's fiber, woken, raises the
        # failure. Only this fiber's own interruption is raised here.
        def write_through(chunk)
          @sink.call(chunk)
          self
        rescue Exception => e # rubocop:disable Lint/RescueException -- the stream ends; raised on if this fiber was interrupted
          interrupted = interruption?(e)
          fail_with(interrupted ? interrupted_by(e) : e)
          raise if interrupted

          self
        end

        def fail_with(error)
          @failure ||= error
          @sink = nil
          @on_failure.call
          # Rails 7.2's abort leaves its queue open (and each write after it
          # empties the queue): the server's fiber would wait in pop for the
          # action's close. Closed, its pop returns nil.
          close
        end

        # What stops this fiber rather than the write: a cancel, a timeout
        # around the write (NeverBlock.timeout's is a RuntimeError inside
        # its block), a signal, an exit.
        def interruption?(error)
          !error.is_a?(StandardError) || error.is_a?(Cancelled) || error.is_a?(Timeout::Error) ||
            error.is_a?(TimeoutError::Expired)
        end

        def interrupted_by(error)
          raise WriteInterrupted, "a write of the stream was interrupted part-way through a chunk (#{error.class})"
        rescue WriteInterrupted => e
          e # (raised and rescued: its cause is `error`)
        end
      end

      # Prepended to ActionController::Live::Response: a response, once
      # committed, stays committed, so every write after the first skips
      # Rails' commit (taking the response's monitor, fetching the cookie
      # jar, waking the response's waiters: none waits on a commit that
      # already happened) and reads `committed?` without the monitor: with
      # the queue's own check, a write took 855 ns before the socket's
      # write, 452 without them (Ruby 3.4 + YJIT).
      module Response
        # @return [Boolean]
        def committed?
          @committed || super
        end

        # Rails' commit, the first time.
        # @return [void]
        def commit!
          super unless @committed
        end
      end

      # Prepended to ActionController::Live::Buffer.
      module Buffer
        private

        # Rails' loop over the queue (the server's fiber), with direct
        # writes taken meanwhile when the queue is a {Queue}.
        def each_chunk(&block)
          queue = @buf
          return super unless queue.is_a?(Queue)

          queue.deliver(block) { |write_queued| super(&write_queued) }
        end

        def neverblock_write_directly(owner)
          return unless @buf.instance_of?(Thread::SizedQueue) && @buf.empty? && !@buf.closed?

          @buf = Queue.new(@buf.max, owner, method(:abort))
        end
      end
    end
  end
end
