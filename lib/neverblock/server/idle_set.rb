# frozen_string_literal: true

begin
  require "neverblock/epoll"
rescue LoadError
  nil # not built (not Linux): each idle connection keeps a fiber (see IdleSet.build)
end

module NeverBlock
  class Server
    # Keep-alive connections waiting for their next request, held without a
    # fiber: each is parked here ({#park}) with its socket in an epoll set of
    # the worker's own ({NeverBlock::Epoll}, ext/neverblock/epoll), and one
    # task ({#run}) waits on that set's descriptor through the scheduler.
    # When a parked socket turns readable (a request, or the client's EOF),
    # the set takes it out and hands the connection to `on_readable` (the
    # server starts a pooled task that reads and serves it). A fiber's
    # stack pages and struct are nine tenths of what an idle connection
    # costs otherwise (docs/benchmarks.md, "Held connections").
    #
    # One per serving process, made in the loop after a fork ({.build} in
    # {Server#serve_here}): an epoll set is never shared between workers.
    # A connection parks only when nothing of its next request is read yet
    # (see Connection#park?), and not at once: its fiber first waits on the
    # socket, until the {IdleSweeper} finds it idle a sweep interval (0.5 s
    # by default) and parks it, so a busy keep-alive connection's next
    # request costs no park, no epoll_ctl and no new task. Beyond
    # {WAITING_FIBERS} such waits a connection whose client is busy waits
    # in its fiber a few milliseconds only ({BriefWaits}) before it parks,
    # and any other parks at once. A connection whose request held its slot
    # for Connection::TURN or longer parks at once, to wait its turn in the
    # order requests arrive, but keeps its fiber, suspended, which the
    # report wakes (Connection#wait_turn), until the sweeper finds it idle.
    # {#unpark} takes out one that is closed while parked (the
    # {IdleSweeper}'s idle timeout, {Server#stop}).
    #
    # Without the extension (not Linux), or with the environment variable
    # `NEVERBLOCK_IDLE_SET=off`, {.build} returns nil and every idle
    # connection waits in its own fiber, as before.
    #
    # Not thread-safe: the server uses it from its loop only.
    class IdleSet
      # The environment variable that turns it off (`off`): the server then
      # waits for each idle connection's next request in a fiber of its own.
      SWITCH = "NEVERBLOCK_IDLE_SET"

      # Connections that may wait for their next request in their own fiber
      # at once (see {Connection}: a busy keep-alive connection's next
      # request usually comes before the {IdleSweeper} parks it, and a fiber
      # waiting is cheaper than a park and a new task); beyond that many,
      # an idle connection of a busy client waits a few milliseconds
      # ({BriefWaits}) and then parks, any other at once. The fibers the pool keeps ({FiberPool::IDLE_LIMIT}) are
      # as many.
      WAITING_FIBERS = FiberPool::IDLE_LIMIT

      # @return [Integer] connections waiting for their next request in
      #   their own fiber now (kept by {Connection}).
      attr_accessor :fiber_waits

      # @return [BriefWaits] the waits beyond {WAITING_FIBERS} (its task is
      #   the server's).
      attr_reader :brief_waits

      # @return [Boolean] whether {.build} makes one: the extension is built
      #   and {SWITCH} is not `off`.
      def self.available?
        defined?(NeverBlock::Epoll) && ENV[SWITCH] != "off" ? true : false
      end

      # @param on_readable [#call] called with a parked {Connection} whose
      #   socket turned readable, once it is out of the set.
      # @return [IdleSet, nil] nil when not {.available?}.
      def self.build(on_readable)
        new(on_readable) if available?
      end

      # @return [String, nil] why there is none on Linux, for the log:
      #   the extension was not built (a Gemfile `path:` gem: Bundler builds
      #   no extension for those), or {SWITCH} is `off`; nil elsewhere.
      def self.missing_reason
        return unless RUBY_PLATFORM.include?("linux")
        return "#{SWITCH}=off" if ENV[SWITCH] == "off"

        "neverblock/epoll is not built (from a Gemfile path: gem, Bundler builds no extension; install the gem, " \
          "or a git: source)" unless defined?(NeverBlock::Epoll)
      end

      # @param on_readable [#call] see {.build}.
      def initialize(on_readable)
        @on_readable = on_readable
        @epoll = Epoll.new
        @io = IO.for_fd(@epoll.fileno, autoclose: false)
        @parked = {} # descriptor => Connection
        @fiber_waits = 0
        @waiting_fibers = WAITING_FIBERS # (a test lowers it)
        @brief_waits = BriefWaits.new
      end

      # @return [Boolean] true when {WAITING_FIBERS} connections wait in
      #   their fibers: the next to go idle waits briefly ({BriefWaits}).
      def crowded?
        @fiber_waits >= @waiting_fibers
      end

      # @return [Integer] connections parked now.
      def size
        @parked.size
      end

      # Parks `connection` until its socket (descriptor `fd`) is readable.
      # @param connection [Connection]
      # @param fd [Integer] its socket's descriptor.
      # @return [void]
      def park(connection, fd)
        @epoll.arm(fd) # one epoll_ctl: a socket parked before is still in the set, disarmed
        @parked[fd] = connection
      end

      # Takes a parked connection out without handing it on (it is being
      # closed): out of the set too, so that its armed socket cannot report
      # after the close if another descriptor still refers to it. Does
      # nothing for one not parked.
      # @param fd [Integer] its socket's descriptor, still open.
      # @return [void]
      def unpark(fd)
        @epoll.delete(fd) if @parked.delete(fd)
      end

      # Takes the descriptor of a connection that reported (and so left the
      # set's bookkeeping) out of the epoll set too: its socket is moving to
      # another process, where the disarmed entry here would outlive this
      # descriptor.
      # @param fd [Integer] its socket's descriptor, still open.
      # @return [void]
      def forget(fd)
        @epoll.delete(fd)
      end

      # Hands a parked connection on to `on_readable` now, as if its socket
      # had reported, and takes it out of the set (the {IdleSweeper} found
      # its request waiting at its idle deadline, before the set reported
      # it). Does nothing for one not parked.
      # @param fd [Integer] its socket's descriptor, still open.
      # @return [void]
      def wake(fd)
        connection = @parked.delete(fd) or return

        @epoll.delete(fd)
        @on_readable.call(connection)
      end

      # Hands each parked connection whose socket turns readable to
      # `on_readable`, until its task is cancelled. The only fiber that
      # waits for the parked ones.
      # @return [void]
      def run
        while true # rubocop:disable Style/InfiniteLoop -- ends by cancellation
          @io.wait_readable
          @epoll.ready.each do |fd|
            # It stays in the set, disarmed (one-shot), until it parks again.
            connection = @parked.delete(fd) or next
            @on_readable.call(connection)
          end
        end
      end

      # Closes the epoll set (its task cancelled first). Connections still
      # parked are the caller's to close.
      # @return [void]
      def close
        @io.close
        @epoll.close
      end
    end
  end
end
