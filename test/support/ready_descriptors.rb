# frozen_string_literal: true

require "socket"
require "io/wait"

# A loop kept busy by IO: more descriptors ready at once than one selector
# call reports (64 on epoll), as a server relaying a thousand upstream
# streams has, for Scheduler#io_late and StartPace.
module ReadyDescriptors
  # Runs the block, on the loop, beside `count` fibers that each wait on a
  # socket that stays readable (a byte never read) and spend 50 µs of CPU at
  # each wake-up, until the block ends.
  def with_ready_fibers(count)
    skip_livelocking_uring if count > 64
    pairs = ready_pairs(count)
    stop = false
    fibers = pairs.map do |reader, _|
      NeverBlock.spawn { wake_when_ready(reader) until stop }
    end
    yield
  ensure
    stop = true
    fibers&.each(&:wait)
    pairs&.flatten&.each(&:close)
  end

  # @return [Array<Array(UNIXSocket, UNIXSocket)>] `count` socket pairs
  #   whose reader stays readable (a byte written, never read).
  def ready_pairs(count)
    Array.new(count) { UNIXSocket.pair.tap { |_, writer| writer.write("x") } }
  end

  # Waits on `reader` (one of #ready_pairs': at once ready) and spends 50 µs
  # of CPU, as a wake-up that handles an event.
  def wake_when_ready(reader)
    reader.wait_readable
    spin_until = Process.clock_gettime(Process::CLOCK_MONOTONIC) + 0.00005
    nil while Process.clock_gettime(Process::CLOCK_MONOTONIC) < spin_until
  end

  # io-event 1.11.2's io_uring selector (the newest for Ruby 3.1) never
  # returns from a call while a hundred fibers wait on descriptors that are
  # always ready: each wait it submits completes before the call has taken
  # the completions in, and the call takes those too. 1.22.3 returns.
  def skip_livelocking_uring
    return unless selector_name == "URing"
    return if Gem::Version.new(IO::Event::VERSION) >= Gem::Version.new("1.22")

    skip "io-event #{IO::Event::VERSION}'s io_uring selector livelocks with descriptors always ready"
  end

  # Scheduler#io_late counts on selectors whose calls report a bounded
  # batch (epoll, kqueue); select(2) and io_uring take every ready
  # descriptor in one call, and leave none for the next turn.
  def skip_unless_batched_selector
    return if %w[EPoll KQueue].include?(selector_name)

    skip "the #{selector_name} selector takes every ready descriptor in one call: nothing is left for the next turn"
  end

  # The running loop's selector (IO::Event::Selector::EPoll => "EPoll").
  def selector_name
    Fiber.scheduler.selector_class.name.split("::").last
  end
end
