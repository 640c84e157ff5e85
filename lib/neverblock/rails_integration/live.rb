# frozen_string_literal: true

module NeverBlock
  module RailsIntegration
    # ActionController::Live on NeverBlock's loop: prepended to
    # `ActionController::Live` by {RailsIntegration.before_serving} (so only
    # in a process NeverBlock::Server serves), it runs a Live action as a
    # task of the request instead of a thread of Rails' own. Rails' seam is
    # `new_controller_thread` (a `Thread.new` in 7.2, a post to
    # `ActionController::Live.live_thread_pool_executor` in 8.x): Rails'
    # `process` hands it the block that runs the action, then waits in
    # `response.await_commit` until the action commits its headers (its
    # first write, or its end), and returns the response whose body the
    # server writes as the action produces it.
    #
    # Here that block runs in a fiber of the request's loop, a child of the
    # request's task (Task::Tree): what ends the request (its response
    # written, its client gone, request_timeout, a stop) cancels the stream
    # at its current wait, as it cancels any work the request spawned.
    # Everything else is Rails' own, run as Rails writes it: the headers
    # commit at the first write, an exception before the commit reaches the
    # request (the 500 page, `rescue_from`), one after it is logged and
    # closes the stream, `ensure` runs, and the reloading interlock counts
    # the stream as inside the app.
    #
    # What this module adds to Rails' code, each only for an action it runs:
    #
    # - the stream's writes go straight to the client from the action's
    #   fiber ({LiveWrites}) rather than through a queue to the server's;
    # - the stream's request slot: once the action committed, the request
    #   only waits for the action's writes, so it gives its `fiber_pool`
    #   slot back (`env["neverblock.mark_as_io_bound"]`, as an app would);
    # - what Rails copies into its thread: Rails copies the request's
    #   fiber-locals (`Thread#[]`) into the action's thread, NeverBlock's own
    #   among them (which task runs, which database connection a
    #   NeverBlock::Postgres client lends this fiber): the action's fiber
    #   keeps its own. Rails 7.2 and 8.1 share the request thread's Active
    #   Support state (`ActiveSupport::IsolatedExecutionState.share_with`),
    #   which under `:fiber` isolation is not the request's (Rails' main
    #   branch shares the isolation context's): the action's fiber gets a
    #   copy of the request fiber's, as Rails gives a thread a copy of its
    #   caller's; CurrentAttributes set before the action are seen in it;
    # - a client that went away: the request's end cancels the stream
    #   ({Cancelled} at its wait), or its next write raises
    #   ActionController::Live::ClientDisconnected. Rails logs that as a
    #   FATAL error with its backtrace and its log line says "Completed 500"
    #   for a response that was sent as 200: here it is one debug line, and
    #   the log line gives the status sent.
    #
    # A request NeverBlock::Server does not serve (no
    # `neverblock.mark_as_io_bound` in its env, or no NeverBlock scheduler on
    # its fiber), and ActionController::TestCase's inline
    # `new_controller_thread`, go to Rails' own code unchanged.
    module Live
      # The prefix of NeverBlock's own fiber-local keys (Task::Tree::CURRENT,
      # the database clients' lent connections).
      OWN_LOCALS = "__neverblock_"

      # One Live action run on the loop: the request fiber that called it,
      # the task and fiber that run it, and the fiber-locals that fiber had
      # before Rails copied the request's.
      Stream = Struct.new(:caller, :task, :fiber, :own_locals)
      private_constant :Stream

      # Rails' `process` for a Live action (request fiber): returns once the
      # action committed its response; on NeverBlock's loop the request then
      # gives its request slot back.
      # @param name [String] the action.
      def process(name)
        return super unless served_on_the_loop?

        result = super
        request.env[::NeverBlock::Server::MARK_AS_IO_BOUND]&.call
        result
      end

      private

      # Rails' seam: runs Rails' block in a task of the request (on its
      # loop) where NeverBlock serves, else in Rails' own thread.
      def new_controller_thread(&block)
        return super unless served_on_the_loop?

        caller = Fiber.current
        LiveWrites.enable(response.stream, Task.current)
        NeverBlock.spawn do
          thread = Thread.current
          own = thread.keys.each_with_object({}) { |key, locals| locals[key] = thread[key] if key.start_with?(OWN_LOCALS) }
          @_neverblock_live = Stream.new(caller, Task.current, Fiber.current, own)
          block.call
        end
      end

      # Called by Rails' block in the action's fiber, after it copied the
      # request's fiber-locals and Active Support state and before the
      # callbacks and the action: puts back the fiber's own NeverBlock
      # locals and shares the request fiber's Active Support state.
      def process_action(*)
        stream = @_neverblock_live
        return super unless stream&.fiber.equal?(Fiber.current)

        thread = Thread.current
        if (own = stream.own_locals)
          stream.own_locals = nil # (not kept for the stream's life)
          thread.keys.each { |key| thread[key] = own[key] if key.start_with?(OWN_LOCALS) }
        end
        share_isolated_state(stream.caller) { super }
      end

      # Gives the action's fiber a copy of `from`'s Active Support state, as
      # Rails' `process` gives its thread the calling thread's: Rails 7.2's
      # share_with replaces the current context's state; 8.x's takes a block
      # and puts the previous state back after it, and from 8.1.3 leaves out
      # `live_streaming_excluded_keys`.
      def share_isolated_state(from, &block)
        state = ::ActiveSupport::IsolatedExecutionState
        return yield unless state.isolation_level == :fiber

        case Live.share_with_form
        when :replace
          state.share_with(from)
          yield
        when :block then state.share_with(from, &block)
        else state.share_with(from, except: self.class.live_streaming_excluded_keys, &block)
        end
      end

      # @api private
      # How this Rails' IsolatedExecutionState.share_with is called (read
      # once: a Method and its parameters were 5 objects a Live request):
      # :replace (7.2), :block (8.0), :except (8.1.3 and later).
      # @return [Symbol]
      def self.share_with_form
        @share_with_form ||= begin
          parameters = ::ActiveSupport::IsolatedExecutionState.method(:share_with).parameters.map(&:last)
          if !parameters.include?(:block) then :replace
          elsif parameters.include?(:except) then :except
          else :block
          end
        end
      end

      # Rails logs an exception that ends a committed stream with its
      # backtrace; one that its client's departure caused is a debug line.
      def log_error(exception)
        return super unless client_gone?(exception)

        ::ActionController::Base.logger&.debug do
          "#{self.class.name}##{action_name}: the stream ended as its client went away (#{exception.class})"
        end
      end

      # The "Completed" line of a stream its client left gives the status
      # the client was sent, not 500.
      def append_info_to_payload(payload)
        super
        payload[:status] = response.status if client_gone?($!) && response.committed?
      end

      # Whether `error` ended this action's stream because its client went
      # away: its request cancelled it, or its writes found the stream
      # aborted (ClientDisconnected is a RuntimeError, "closed stream" an
      # IOError).
      def client_gone?(error)
        stream = @_neverblock_live
        return false unless error && stream&.fiber.equal?(Fiber.current)

        case error
        when Cancelled then stream.task.cancel_requested?
        when ::ActionController::Live::ClientDisconnected, IOError then !response.stream.connected?
        else false
        end
      end

      # Rails hands a controller's instance variables to its views, except
      # its own: this one is not the app's either.
      def _protected_ivars
        [*super, :@_neverblock_live]
      end

      def served_on_the_loop?
        request.env.key?(::NeverBlock::Server::MARK_AS_IO_BOUND) && NeverBlock.neverblocking?
      end
    end
  end
end
