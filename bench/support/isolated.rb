# frozen_string_literal: true

module NeverBlockBench
  # Runs a block in a forked child process and returns its value, so that one
  # measurement cannot disturb the next: each starts from the same heap, its
  # threads and fibers die with it, its peak RSS is its own, and a crash or a
  # hang costs one cell of a table rather than the whole run.
  module Isolated
    # What a failed or timed-out child reports instead of a value.
    Failure = Struct.new(:error_class, :message) do
      def to_s
        "#{error_class}: #{message}"
      end
    end

    module_function

    # @param timeout [Float] seconds before the child is killed
    # @yieldreturn [Object] a value Marshal can dump
    # @return [Object, Failure] the block's value, or a Failure describing the
    #   exception it raised, its death, or the timeout
    def run(timeout:)
      reader, writer = IO.pipe
      pid = fork do
        reader.close
        report(writer) { yield }
      end
      writer.close
      collect(pid, reader, timeout)
    ensure
      reader&.close unless reader&.closed?
      writer&.close unless writer&.closed?
    end

    # Child side: writes the value or the failure, then leaves without
    # running the parent's at_exit handlers.
    def report(writer)
      result =
        begin
          yield
        rescue Exception => e # rubocop:disable Lint/RescueException -- reported to the parent
          Failure.new(e.class.name, e.message.lines.first.to_s.strip)
        end
      writer.write(Marshal.dump(result))
      writer.close
      exit!(0)
    rescue Exception # rubocop:disable Lint/RescueException
      exit!(1)
    end

    def collect(pid, reader, timeout)
      data = read_with_deadline(reader, Process.clock_gettime(Process::CLOCK_MONOTONIC) + timeout)
      if data.nil?
        Process.kill("KILL", pid)
        Process.wait(pid)
        return Failure.new("Timeout", "killed after #{timeout} s")
      end

      _, status = Process.wait2(pid)
      return Marshal.load(data) unless data.empty? # rubocop:disable Security/MarshalLoad -- our own child

      Failure.new("Died", status.signaled? ? "killed by signal #{status.termsig}" : "exit status #{status.exitstatus}")
    end

    # @return [String, nil] everything the child wrote, nil on timeout
    def read_with_deadline(reader, deadline)
      data = +"".b
      loop do
        remaining = deadline - Process.clock_gettime(Process::CLOCK_MONOTONIC)
        return nil if remaining <= 0
        next unless IO.select([reader], nil, nil, remaining)

        chunk = reader.read_nonblock(65_536, exception: false)
        return data if chunk.nil?

        data << chunk unless chunk == :wait_readable
      end
    end
  end
end
