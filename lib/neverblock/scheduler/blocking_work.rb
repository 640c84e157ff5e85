# frozen_string_literal: true

module NeverBlock
  class Scheduler
    # Blocking work: calls that would block the whole thread, done off the
    # loop while only the calling fiber waits. Most run on the scheduler's
    # thread pool (ThreadPool): {NeverBlock.defer}'s block, DNS lookups,
    # GVL-releasing C calls (#offload; Ruby hands them to
    # blocking_operation_wait from 4.0 on, see OFFLOAD_HOOK), and
    # Process.wait for any child or with WNOHANG; Process.wait for one child
    # waits in the selector (a pidfd) instead.
    #
    # Who calls it, and when:
    # - a non-blocking fiber on the loop's thread: #defer (through
    #   NeverBlock.defer), and Ruby's hooks #process_wait, #address_resolve
    #   and (Ruby 4.0+) #blocking_operation_wait;
    # - ThreadPool::Job, on the loop's thread once its work is done (carried
    #   there by Scheduler#post): #job_done.
    #
    # Contracts:
    # - The waiting fiber suspends in Scheduler#suspend and re-checks
    #   Job#done? each time it is woken; #job_done wakes it through
    #   Scheduler#wake, so a late result never resumes it in another wait.
    # - A fiber interrupted while it waits: #defer gives up at once and the
    #   job's result is dropped (ThreadPool::Job#abandon); #offload holds
    #   the interruption until the operation has ended (it works on memory
    #   of the caller's C frame).
    module BlockingWork
      # Runs `block` on the scheduler's thread pool and suspends only the
      # calling fiber until it finishes. If the fiber is cancelled or times out
      # meanwhile, the block still runs to its end; its result is dropped.
      #
      # @return [Object] the block's value.
      # @raise [Exception] whatever the block raised.
      def defer(&block)
        job = ThreadPool::Job.new(block, self, Fiber.current)
        @thread_pool.submit(job)
        suspend until job.done?
        job.result
      ensure
        job&.abandon
      end

      # @api private
      # Called (on the loop thread) when a thread-pool job has finished.
      def job_done(job)
        wake(job.fiber)
      end

      # Fiber::Scheduler hook: `Process.wait` and friends.
      # @return [Process::Status, nil]
      def process_wait(pid, flags)
        # pidfd waits need a concrete pid and a blocking wait; anything else
        # (any child, WNOHANG) is answered by a thread-pool thread.
        if pid.positive? && (flags & Process::WNOHANG).zero?
          wait_for_child(pid, flags)
        else
          defer { Process::Status.wait(pid, flags) }
        end
      end

      # Fiber::Scheduler hook: DNS. The system resolver (getaddrinfo, honouring
      # /etc/hosts and nsswitch exactly like blocking code) runs on the thread
      # pool. Returns IPv6 and IPv4 addresses.
      # @return [Array<String>]
      def address_resolve(hostname)
        host = hostname.split("%", 2).first # strip an IPv6 zone ("fe80::1%eth0")
        host = host[1..-2] if host.start_with?("[") && host.end_with?("]")
        # An address literal needs no lookup (and no thread): the common case
        # of connecting to 127.0.0.1 or ::1.
        return [host] if IPV4_LITERAL.match?(host) || (host.include?(":") && IPV6_LITERAL.match?(host))

        defer { Addrinfo.getaddrinfo(host, nil, nil, :STREAM).map(&:ip_address).uniq }
      end

      IPV4_LITERAL = /\A\d{1,3}(?:\.\d{1,3}){3}\z/.freeze
      IPV6_LITERAL = /\A[\h:]*:[\h:.]*\z/.freeze
      private_constant :IPV4_LITERAL, :IPV6_LITERAL

      # Whether Ruby gets the blocking_operation_wait hook (below). Ruby 3.4
      # hands it IO.copy_stream too, whose waits for its IOs then run on the
      # pool thread but ask for the scheduler of the loop's thread: when the
      # loop's thread is in the loop at that instant there is none, and the
      # copy blocks its pool thread in poll(2) for its whole life (two copies
      # relaying a connection both ways deadlock a pool of one); when it is
      # running a fiber, the pool thread calls this scheduler's io_wait,
      # which fails (a fiber of another thread), and the copy stops with
      # the bytes it had not copied left unread. The test suite hung that way
      # on Ruby 3.4 in MySQLConnectTrilogyTest, whose proxy copies with
      # IO.copy_stream. Ruby cannot be told which operations to keep, and
      # run in place from the hook the operation would be offered to it
      # again; so on 3.4 Ruby runs them all in place, as without a scheduler
      # (zlib, File.read, IO#close then hold the loop while they run, as on
      # Ruby 3.3), and IO.copy_stream waits through io_wait on the loop.
      OFFLOAD_HOOK = RUBY_VERSION >= "4.0"

      # @api private
      # Runs a blocking call that releases the GVL (Ruby's `work`, a Proc on
      # 3.4, an operation object on 4.0) on the thread pool; only the
      # calling fiber waits. Ruby 4.0+ calls it as the Fiber::Scheduler hook
      # blocking_operation_wait (OFFLOAD_HOOK says why not 3.4).
      #
      # Unlike {#defer}, the fiber waits for the operation to end even if it is
      # cancelled or times out meanwhile: the operation works on memory owned
      # by the caller's C frame, which must outlive it. The interruption is
      # raised once the operation has ended.
      # @return [void]
      def offload(work)
        # No loop to wait in (a forked child detaching from its parent's loop
        # may close the loop's pipe through here): run it in place,
        # as Ruby would without a scheduler. Returning without running it
        # would report a result that never happened.
        return without_hooks { work.call } if @forked || @closed || Process.pid != @pid

        job = ThreadPool::Job.new(work, self, Fiber.current)
        @thread_pool.submit(job)
        interruption = nil
        begin
          suspend until job.done?
        rescue Exception => e # rubocop:disable Lint/RescueException -- held until the operation ends
          interruption ||= e
          retry
        end
        raise interruption if interruption

        job.result
      end

      alias_method :blocking_operation_wait, :offload if OFFLOAD_HOOK

      private

      # Waits for one child through a pidfd in the selector. A pid with no
      # process behind it (a child already reaped: IO#close of a popen'd IO
      # after Process.wait took its child) makes pidfd_open fail with ESRCH,
      # where Ruby's waitpid answers ECHILD at once: IO#close returns,
      # Process.wait raises Errno::ECHILD. That answer comes from waitpid
      # itself, on the thread pool (called here, it would come back to this
      # hook), so that a pid reused meanwhile cannot hold the loop.
      def wait_for_child(pid, flags)
        fiber = Fiber.current
        in_selector(fiber) { @selector.process_wait(fiber, pid, flags) }
      rescue Errno::ESRCH
        defer { Process::Status.wait(pid, flags) }
      end
    end
  end
end
