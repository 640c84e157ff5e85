# frozen_string_literal: true

require "minitest/autorun"
require "neverblock"
require "neverblock/minitest"
require "stringio"
require "socket"
require_relative "fixtures/child_ruby"
require_relative "support/watchdog"
require_relative "support/child_rendezvous"
require_relative "support/cpu_report"

# Shared helpers for NeverBlock's own suite. Every test class that includes
# NeverBlock::Minitest runs each test inside NeverBlock.run with a timeout
# and fails tests that leak tasks or file descriptors.
module TestSupport
  # A pattern for a backtrace frame of method `name`: "in `sleep'" before
  # Ruby 3.4, "in 'Kernel#sleep'" from 3.4 on.
  # @return [String] regexp source
  def self.frame(name)
    "in [`'](?:[\\w:]+[#.])?#{Regexp.escape(name)}'"
  end

  include ChildRuby

  # Skips the test on the io-event selector this pass runs on
  # (NEVERBLOCK_SELECTOR; bin/test --selector) when it is one of `selectors`:
  # for a failure found on that selector and not fixed yet, named in `bug`, so
  # that the rest of the suite runs on it in CI. Every such skip is printed in
  # the pass's skip list (minitest -v) with the bug.
  def known_failure_on(*selectors, bug:)
    current = ENV.fetch("NEVERBLOCK_SELECTOR", "").strip.downcase
    skip "known failure on the #{current} selector: #{bug}" if selectors.map(&:to_s).include?(current)
  end

  # railties' minitest plugin loads Active Support into every test process
  # (at isolation level :thread). The first NeverBlock::Server started
  # would warn that it switches the level to :fiber, in whichever test that
  # is: a test that expects a quiet log would fail or pass by the seed.
  def before_setup
    if defined?(ActiveSupport::IsolatedExecutionState) && ActiveSupport::IsolatedExecutionState.isolation_level != :fiber
      ActiveSupport::IsolatedExecutionState.isolation_level = :fiber
    end
    super
  end

  # Seconds on the monotonic clock.
  # Polls the block (every 20 ms) until it returns a truthy value, and
  # returns that; fails after `timeout` seconds with #failure_context (what a
  # test class's server printed, say) after the message.
  def eventually(timeout: 30)
    deadline = now + timeout
    until (value = yield)
      if now > deadline
        where = caller_locations(1, 1).first
        flunk "condition not met within #{timeout} s (#{File.basename(where.path)}:#{where.lineno})#{failure_context}"
      end
      sleep 0.02
    end
    value
  end

  # What `socket` sent until `text` arrived (flunks after 30 s, or at EOF).
  def read_until(socket, text, timeout: 30)
    received = +""
    deadline = now + timeout
    until received.include?(text)
      socket.wait_readable([deadline - now, 0].max) or flunk "no #{text.inspect} within #{timeout} s: #{received.inspect}"
      received << socket.readpartial(65_536)
    end
    received
  rescue EOFError
    flunk "the stream ended before #{text.inspect}: #{received.inspect}"
  end

  # What `socket` sent until the peer closed it (raises when a read waits
  # `timeout` seconds, or, with `within`, when the peer has not closed it
  # that many seconds after the call: a stream that goes on sending).
  def read_all(socket, timeout: 10, within: nil)
    data = +""
    deadline = now + within if within
    loop do
      wait = deadline ? [timeout, deadline - now].min : timeout
      unless wait.positive? && socket.wait_readable(wait)
        raise "no EOF within #{deadline ? within : timeout} s; got #{data.inspect}"
      end

      data << socket.readpartial(65_536)
    end
  rescue EOFError, Errno::ECONNRESET
    data
  end

  # What a failed #eventually adds to its message; "" unless a class says.
  def failure_context = ""

  def now
    NeverBlock::Clock.now
  end

  # Measures the block's wall time in seconds.
  def elapsed
    started = now
    yield
    now - started
  end

  # Captures what NeverBlock logs while the block runs.
  # @return [String]
  def capture_log(&)
    output = StringIO.new
    with_log(output, &)
    output.string
  end

  # NeverBlock logs to `io` while the block runs (what it logged so far
  # can then be read inside the block, e.g. for a failure message).
  # @return [Object] the block's value.
  def with_log(io)
    previous = NeverBlock.logger
    NeverBlock.logger = Logger.new(io)
    yield
  ensure
    NeverBlock.logger = previous
  end

  # Sets `owner`'s constant `name` to `value` (a tunable the code reads
  # when it runs), without Ruby's warning for a constant set again.
  # @return [Object] its value before, to put back the same way.
  def replace_constant(owner, name, value)
    old = owner.const_get(name, false)
    owner.send(:remove_const, name)
    owner.const_set(name, value)
    old
  end

  # Runs the block with `owner`'s constant `name` set to `value`
  # (#replace_constant), then puts it back.
  # @return what the block returns.
  def with_constant(owner, name, value)
    old = replace_constant(owner, name, value)
    yield
  ensure
    replace_constant(owner, name, old) if old
  end

  # Runs `code` in a child Ruby with lib/ on the load path; the child is
  # killed (and the test fails) if it runs longer than `timeout` seconds.
  # @return [Array(String, String, Process::Status)] stdout, stderr, status.
  def run_ruby(code, timeout: 30, env: {})
    ruby_child("-e", code, env: env, timeout: timeout)
  end
end

# A count-down latch, to order events without guessing with `sleep`: #wait
# returns once #count_down was called `count` times. Works between fibers
# of one loop (Mutex and ConditionVariable go through the scheduler) and
# between threads.
class Latch
  def initialize(count = 1)
    @count = count
    @mutex = Thread::Mutex.new
    @reached = Thread::ConditionVariable.new
  end

  def count_down
    @mutex.synchronize do
      @count -= 1
      @reached.broadcast if @count <= 0
    end
  end

  def wait
    @mutex.synchronize { @reached.wait(@mutex) while @count.positive? }
  end
end

# Base class for tests that run inside the event loop.
# A test that runs for minutes gets what the process is doing written to
# stderr (test/support/watchdog.rb).
class NeverBlockTest < Minitest::Test
  include TestSupport
  include NeverBlock::Minitest
  include TestWatchdog::Hook # outermost: the loop's closing is watched too
  make_my_diffs_pretty!
end

# Base class for tests that run outside any event loop (they start their own).
class PlainTest < Minitest::Test
  include TestSupport
  include TestWatchdog::Hook
end

# NeverBlockTest::Databases: how to reach the PostgreSQL and MariaDB that bin/test starts.
require_relative "support/databases"
# NeverBlockTest::PostgresHelpers and ::MySQLHelpers: helpers shared by the database tests.
require_relative "support/pool_tracking"
require_relative "support/postgres"
require_relative "support/mysql"
# NeverBlockTest::DatabaseClientContract and ::DatabaseRecoveryContract: one suite, both databases.
require_relative "support/database_client_contract"
require_relative "support/database_recovery_contract"
require_relative "support/server_process"
require_relative "support/certificates"
