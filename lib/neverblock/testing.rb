# frozen_string_literal: true

require_relative "../neverblock"

module NeverBlock
  # The engine behind the minitest and RSpec helpers, usable from any test
  # framework: runs one test body inside {NeverBlock.run} with a timeout, and
  # fails the test when it leaves tasks running or file descriptors open.
  module Testing
    # Default seconds a test may take.
    DEFAULT_TIMEOUT = 10

    # A test broke one of the rules above; its message says which and shows
    # the backtraces of the fibers involved.
    class Failure < NeverBlock::BaseError
    end

    # The test ran out of time.
    class TimeoutFailure < Failure
    end

    # The test finished but left tasks running.
    class LeakedTasks < Failure
    end

    # The test finished but left file descriptors open.
    class LeakedDescriptors < Failure
    end

    class << self
      # @return [Numeric] default per-test timeout in seconds:
      #   `ENV["NEVERBLOCK_TEST_TIMEOUT"]` or 10.
      def default_timeout
        text = ENV.fetch("NEVERBLOCK_TEST_TIMEOUT", nil)
        return DEFAULT_TIMEOUT.to_f if text.nil? || text.strip.empty?

        seconds = Float(text, exception: false)
        raise ArgumentError, "NEVERBLOCK_TEST_TIMEOUT must be a number of seconds, got #{text.inspect}" unless seconds

        NeverBlock.validate_timeout!(seconds, :NEVERBLOCK_TEST_TIMEOUT)
      end

      # Runs `body` as a task in a fresh event loop.
      #
      # @param timeout [Numeric] seconds the body may take; on expiry every
      #   live fiber's backtrace goes into the failure message and the tasks
      #   are cancelled.
      # @param check_descriptors [Boolean] fail when the test leaves file
      #   descriptors open that it did not have at the start (Linux).
      # @param label [String] names the test in failure messages.
      # @return [Object] the body's value.
      # @raise [Failure] on timeout or leaks; otherwise whatever the body raised.
      def run(timeout: default_timeout, check_descriptors: true, label: "test", &body)
        NeverBlock.validate_timeout!(timeout, :timeout)
        before = check_descriptors ? open_descriptors : nil
        result = NeverBlock.run { supervise(timeout, label, body) }
        check_leaked_descriptors(before, label) if before
        result
      end

      # @return [Hash{Integer => String}, nil] fd => what it points at, or nil
      #   where /proc/self/fd does not exist.
      def open_descriptors
        return nil unless File.directory?("/proc/self/fd")

        Dir.children("/proc/self/fd").each_with_object({}) do |name, fds|
          fds[Integer(name)] = File.readlink("/proc/self/fd/#{name}")
        rescue SystemCallError
          nil # the fd Dir.children itself used, closed by now
        end
      end

      private

      def supervise(timeout, label, body)
        scheduler = Fiber.scheduler
        supervisor = Fiber.current
        test = scheduler.spawn(observed: true, &body)
        begin
          NeverBlock.timeout(timeout) { test.wait }
        rescue NeverBlock::TimeoutError
          report = fiber_report(scheduler, supervisor)
          stop_others(scheduler, supervisor)
          raise TimeoutFailure, "#{label} timed out after #{timeout} s; live fibers:\n#{report}"
        end

        leaked = others(scheduler, supervisor)
        unless leaked.empty?
          report = fiber_report(scheduler, supervisor)
          stop_others(scheduler, supervisor)
          test.value # the test's own failure explains more than the leak
          raise LeakedTasks, "#{label} left #{leaked.size} task(s) running; wait for or cancel them:\n#{report}"
        end
        test.value
      end

      def others(scheduler, supervisor)
        scheduler.tasks.reject { |task| task.fiber.equal?(supervisor) }
      end

      def stop_others(scheduler, supervisor)
        tasks = others(scheduler, supervisor)
        tasks.each(&:cancel)
        tasks.each(&:wait)
      end

      def fiber_report(scheduler, supervisor)
        others(scheduler, supervisor).map do |task|
          trace = task.fiber&.backtrace || ["(not started)"]
          "  #{task.inspect}\n    #{trace.join("\n    ")}"
        end.join("\n")
      end

      def check_leaked_descriptors(before, label)
        after = open_descriptors || {}
        leaked = after.reject { |fd, target| before[fd] == target }
        return if leaked.empty?

        list = leaked.map { |fd, target| "  fd #{fd} -> #{target}" }.join("\n")
        raise LeakedDescriptors, "#{label} left #{leaked.size} file descriptor(s) open; close them:\n#{list}"
      end
    end
  end
end
