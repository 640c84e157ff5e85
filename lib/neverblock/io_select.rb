# frozen_string_literal: true

require_relative "../neverblock"

module NeverBlock
  # `require "neverblock/io_select"`: IO.select waits through NeverBlock on
  # Ruby 3.1 too. The one place NeverBlock changes a core method, and only
  # when asked to.
  #
  # Ruby 3.2 added the `io_select` scheduler hook; on 3.1 `IO.select` in a
  # fiber blocks the whole thread, every other request with it. Gems that
  # wait with IO.select (excon, bunny's AMQP handshake, net-ssh, app code)
  # then run one at a time under NeverBlock: ten 0.5 s excon calls take
  # 5 s instead of 0.5 s.
  #
  # Required on 3.1, this prepends {IOSelect} to IO's singleton class:
  # `IO.select` from a non-blocking fiber of a NeverBlock loop goes to the
  # scheduler's #io_select (the same code that serves the hook on 3.2+);
  # anywhere else (no loop, a blocking fiber, another scheduler) it is
  # Ruby's own, untouched. Results, errors (TypeError, IOError on a closed
  # IO, ArgumentError for a negative timeout) and buffered data are
  # IO.select's. `Kernel#select` (the receiverless form) is not changed.
  # On Ruby 3.2+ requiring it does nothing.
  module IOSelect
    # Whether this Ruby needs it (no io_select hook).
    NEEDED = !Fiber.respond_to?(:blocking)

    # IO.select, waiting through NeverBlock when called from one of its
    # fibers (see the module comment).
    # @return [Array<Array<IO>>, nil]
    def select(readables, writables = nil, exceptables = nil, timeout = nil)
      scheduler = Fiber.scheduler
      return super unless scheduler.is_a?(NeverBlock::Scheduler) && !Fiber.current.blocking?

      scheduler.io_select(readables, writables, exceptables, timeout)
    end
  end

  IO.singleton_class.prepend(IOSelect) if IOSelect::NEEDED && !IO.singleton_class.include?(IOSelect)
end
