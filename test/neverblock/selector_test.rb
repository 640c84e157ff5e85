# frozen_string_literal: true

require "test_helper"
require_relative "../fixtures/child_ruby"

# Choosing the io-event selector (NEVERBLOCK_SELECTOR or `selector:`), and a
# real workload on each selector this build of io-event has. The loops here
# are started with a chosen selector, so these tests run outside one.
class SelectorTest < PlainTest
  include ChildRuby

  SELECTORS = { "epoll" => :EPoll, "uring" => :URing, "select" => :Select }.freeze

  # The workload's size: echo clients, and tasks sleeping 0.1 s at once.
  CLIENTS = 5
  SLEEPERS = 20
  # Each sleeper's nap: one after the other they take 10 s, together about
  # 0.5 s; the check allows 5 s, since Process.spawn in the same workload can
  # hold the GVL for half a second on a machine busy with other test passes.
  NAP = 0.5

  # Prints the selector class a fresh NeverBlock.run picks.
  PICKED = 'require "neverblock"; puts NeverBlock.run { Fiber.scheduler.selector_class }'

  def test_default_is_epoll
    out, err, status = ruby_child("-e", PICKED, env: { "NEVERBLOCK_SELECTOR" => nil })
    assert status.success?, err
    assert_equal "IO::Event::Selector::EPoll", out.strip
    assert_equal IO::Event::Selector::EPoll, NeverBlock::Selector.default
  end

  def test_environment_variable_picks_each_available_selector
    SELECTORS.each do |name, constant|
      next unless IO::Event::Selector.const_defined?(constant)

      out, err, status = ruby_child("-e", PICKED, env: { "NEVERBLOCK_SELECTOR" => name })
      assert status.success?, err
      assert_equal "IO::Event::Selector::#{constant}", out.strip, "NEVERBLOCK_SELECTOR=#{name}"
      assert_empty err, "no warning for an available selector"
    end
  end

  def test_selector_option_picks_the_selector
    SELECTORS.each do |name, constant|
      next unless IO::Event::Selector.const_defined?(constant)

      assert_equal IO::Event::Selector.const_get(constant),
                   NeverBlock.run(selector: name.to_sym) { Fiber.scheduler.selector_class }
    end
  end

  def test_the_option_wins_over_the_environment_variable
    code = 'require "neverblock"; puts NeverBlock.run(selector: :epoll) { Fiber.scheduler.selector_class }'
    out, err, status = ruby_child("-e", code, env: { "NEVERBLOCK_SELECTOR" => "select" })
    assert status.success?, err
    assert_equal "IO::Event::Selector::EPoll", out.strip
  end

  def test_names_ignore_case_and_surrounding_space
    assert_equal IO::Event::Selector::Select, NeverBlock::Selector.resolve(" Select ")
    assert_equal IO::Event::Selector::EPoll, NeverBlock::Selector.resolve(:EPOLL)
  end

  def test_unknown_name_raises_argument_error_listing_the_choices
    error = assert_raises(ArgumentError) { NeverBlock.run(selector: "poll") { flunk "ran" } }
    assert_equal 'unknown selector "poll" (NEVERBLOCK_SELECTOR); use one of: epoll, uring, select, kqueue', error.message
    assert_nil Fiber.scheduler, "no half-made loop is left on the thread"
  end

  def test_unknown_name_in_the_environment_fails_the_run
    code = 'require "neverblock"; NeverBlock.run { puts "ran" }'
    out, err, status = ruby_child("-e", code, env: { "NEVERBLOCK_SELECTOR" => "iocp" })
    refute status.success?
    assert_empty out
    assert_includes err, 'unknown selector "iocp" (NEVERBLOCK_SELECTOR); use one of: epoll, uring, select, kqueue'
    assert_includes err, "(ArgumentError)"
  end

  def test_uring_is_used_when_compiled_in_else_falls_back_to_epoll_with_a_warning
    picked = nil
    log = capture_log { picked = NeverBlock.run(selector: "uring") { Fiber.scheduler.selector_class } }
    if IO::Event::Selector.const_defined?(:URing)
      assert_equal IO::Event::Selector::URing, picked
      assert_empty log
    else
      assert_equal IO::Event::Selector::EPoll, picked
      assert_includes log, "selector uring is not available in this build of io-event; using IO::Event::Selector::EPoll"
    end
  end

  # The same fallback, exercised on every Linux build: kqueue is a known
  # name that io-event only compiles on BSD and macOS.
  def test_a_known_selector_missing_from_this_build_falls_back_with_a_warning
    skip "this build has KQueue" if IO::Event::Selector.const_defined?(:KQueue)

    picked = nil
    log = capture_log { picked = NeverBlock.run(selector: "kqueue") { Fiber.scheduler.selector_class } }
    assert_equal IO::Event::Selector::EPoll, picked
    assert_equal 1, log.scan("not available").size
    assert_match(/WARN -- NeverBlock: selector kqueue is not available in this build of io-event; using IO::Event::Selector::EPoll/,
                 log)
  end

  SELECTORS.each do |name, constant|
    define_method("test_#{name}_runs_sockets_timers_threads_and_processes") do
      skip "io-event was built without #{constant}" unless IO::Event::Selector.const_defined?(constant)

      result = NeverBlock.run(selector: name) do
        assert_equal IO::Event::Selector.const_get(constant), Fiber.scheduler.selector_class
        workload
      end
      assert_equal expected_workload_result, result
    end
  end

  private

  # Sockets (an echo server and clients), timers (concurrent sleeps), a
  # pipe and a queue fed from other threads, and child processes, all at once.
  def workload
    server = TCPServer.new("127.0.0.1", 0)
    acceptor = NeverBlock.spawn do
      Array.new(CLIENTS) do
        connection = server.accept
        NeverBlock.spawn do
          connection.write(connection.gets.upcase)
        ensure
          connection.close
        end
      end.each(&:wait)
    end
    clients = Array.new(CLIENTS) do |i|
      NeverBlock.spawn do
        TCPSocket.open("127.0.0.1", server.addr[1]) do |socket|
          socket.write("client #{i}\n")
          socket.read
        end
      end
    end

    started = now
    sleepers = Array.new(SLEEPERS) { |i| NeverBlock.spawn { sleep NAP; i } }

    piped = NeverBlock.spawn do
      IO.pipe do |reader, writer|
        writer_thread = Thread.new { writer.write("from a thread") }
        data = reader.read(13)
        writer_thread.join
        data
      end
    end
    queue = Thread::Queue.new
    queued = NeverBlock.spawn { queue.pop }
    Thread.new { queue << :queued }.join

    children = [0, 3].map do |code|
      NeverBlock.spawn do
        pid = Process.spawn("sh", "-c", "exit #{code}")
        _, status = Process.wait2(pid)
        status.exitstatus
      end
    end

    slept = NeverBlock.wait_all(sleepers)
    sleep_time = now - started
    answers = NeverBlock.wait_all(clients)
    acceptor.wait
    server.close
    {
      answers: answers,
      slept: slept,
      sleeps_overlapped: sleep_time < SLEEPERS * NAP / 2,
      piped: piped.value,
      queued: queued.value,
      exit_codes: NeverBlock.wait_all(children)
    }
  end

  def expected_workload_result
    {
      answers: Array.new(CLIENTS) { |i| "CLIENT #{i}\n" },
      slept: (0...SLEEPERS).to_a,
      sleeps_overlapped: true,
      piped: "from a thread",
      queued: :queued,
      exit_codes: [0, 3]
    }
  end
end
