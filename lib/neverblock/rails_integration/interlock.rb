# frozen_string_literal: true

module NeverBlock
  module RailsIntegration
    # Rails' code-reloading interlock (`ActiveSupport::Dependencies.interlock`)
    # for requests that are fibers of one thread. Rails' own
    # (ActiveSupport::Concurrency::ShareLock) counts who is inside a request
    # by thread: to it, all of NeverBlock's concurrent requests are one
    # holder, so a request that finds changed files unloads the app's
    # constants while the others are still running them (they fail with
    # `Zeitwerk::SetupRequired`, `uninitialized constant PostsController`),
    # or waits on itself. This one counts each fiber (a thread's requests run
    # in its root fiber, so threads are counted too):
    #
    # - a request is inside the app from `start_running` to `done_running`
    #   (Rails' executor calls them around each request when reloading is on);
    # - unloading (the reloader, on a request that found changed files)
    #   waits until no other request is inside, and new requests wait while
    #   it unloads;
    # - a request waiting to unload is not counted as inside, so two that
    #   both found changes do not wait for each other (they unload in turn);
    # - requests arriving while one waits to unload still enter (no writer
    #   preference): one may be a child of a request already inside (an
    #   ActionController::Live stream), which must not wait for its parent
    #   to finish. A development server is never busy enough to starve it.
    #
    # {RailsIntegration.before_serving} puts it in place when the app
    # reloads code. It uses a Thread::Mutex and ConditionVariable, which
    # suspend only the waiting fiber under NeverBlock's scheduler.
    class Interlock
      def initialize
        @mutex = Thread::Mutex.new
        @changed = Thread::ConditionVariable.new
        @inside = Hash.new(0).compare_by_identity # fiber => nesting depth
        @waiting_to_unload = {}.compare_by_identity
        @unloader = nil
        @unloading_depth = 0
      end

      # A request enters the app (Rails' executor, when reloading is on);
      # waits while another fiber unloads.
      # @return [void]
      def start_running
        fiber = Fiber.current
        @mutex.synchronize do
          @changed.wait(@mutex) while @unloader && !@unloader.equal?(fiber)
          @inside[fiber] += 1
        end
      end

      # @return [void]
      def done_running
        fiber = Fiber.current
        @mutex.synchronize do
          depth = @inside[fiber] - 1
          depth.positive? ? @inside[fiber] = depth : @inside.delete(fiber)
          @changed.broadcast
        end
      end

      # @yield inside the app.
      def running
        start_running
        begin
          yield
        ensure
          done_running
        end
      end

      # Waits until no other request is inside the app, then holds it for
      # this fiber alone (re-entrant).
      # @return [void]
      def start_unloading
        fiber = Fiber.current
        @mutex.synchronize do
          if @unloader.equal?(fiber)
            @unloading_depth += 1
            next
          end
          @waiting_to_unload[fiber] = true
          begin
            @changed.wait(@mutex) while @unloader || others_inside?(fiber)
          ensure
            @waiting_to_unload.delete(fiber)
          end
          @unloader = fiber
          @unloading_depth = 1
        end
      end

      # @return [void]
      def done_unloading
        @mutex.synchronize do
          @unloading_depth -= 1
          next if @unloading_depth.positive?

          @unloader = nil
          @changed.broadcast
        end
      end

      # @yield with no other request inside the app.
      def unloading
        start_unloading
        begin
          yield
        ensure
          done_unloading
        end
      end

      # Rails' no-ops since Zeitwerk (kept for callers: ActiveRecord's
      # async queries, older gems).
      def loading
        yield if block_given?
      end

      def permit_concurrent_loads
        yield if block_given?
      end

      # What ActionDispatch::DebugLocks shows: nothing here (it reads
      # ShareLock's per-thread internals).
      def raw_state
        yield({})
      end

      private

      def others_inside?(fiber)
        @inside.each_key.any? { |other| !other.equal?(fiber) && !@waiting_to_unload.key?(other) }
      end
    end
  end
end
