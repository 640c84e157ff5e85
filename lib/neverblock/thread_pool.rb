# frozen_string_literal: true

module NeverBlock
  # A bounded pool of threads for work that would block the event loop: CPU
  # work, C extensions that hold the GVL or block, getaddrinfo. Threads start
  # lazily, up to `size`; further jobs queue FIFO. Used through
  # {NeverBlock.defer}.
  class ThreadPool
    # One unit of work, run on a pool thread and handed back to the loop.
    # @api private
    class Job
      attr_reader :fiber

      def initialize(block, scheduler, fiber)
        @block = block
        @scheduler = scheduler
        @fiber = fiber
        @done = false
        @abandoned = false
        @value = nil
        @error = nil
        @telemetry = Telemetry.context # the waiting fiber's: the block's spans are its children
      end

      # Runs on a pool thread.
      def perform
        @value = @telemetry ? Telemetry.within(@telemetry, &@block) : @block.call
      rescue Exception => e # rubocop:disable Lint/RescueException -- handed to the waiting fiber
        @error = e
      ensure
        @done = true # before the post: the woken fiber must find it done
        begin
          @scheduler.post(self) unless @abandoned
        rescue ClosedError
          nil # the waiting fiber saw @done and went on, and its loop has closed since
        end
      end

      # Runs on the loop thread, via Scheduler#post.
      def call
        @scheduler.job_done(self) unless @abandoned
      end

      def done?
        @done
      end

      # The waiting fiber gave up (cancelled, timed out): drop the result.
      def abandon
        @abandoned = true
      end

      def result
        raise @error if @error

        @value
      end
    end

    # @return [Integer] the most threads the pool runs at once.
    attr_reader :size

    # @param size [Integer] maximum number of threads.
    def initialize(size)
      @size = size
      @queue = Thread::Queue.new
      @threads = []
      @idle = 0 # threads waiting for a job
      @pending = 0 # jobs submitted but not yet picked up
      @lock = Thread::Mutex.new
    end

    # Queues a job, starting a thread if all are busy and the pool has room.
    # @param job [Job]
    # @return [void]
    def submit(job)
      @lock.synchronize do
        @pending += 1
        @threads << spawn_thread if @pending > @idle && @threads.size < @size
      end
      @queue << job
    end

    # Stops the threads after the jobs already queued, and joins them.
    # @return [void]
    def shutdown
      @queue.close
      @threads.each(&:join)
      @threads.clear
    end

    private

    def spawn_thread
      thread = Thread.new do
        while (job = next_job)
          job.perform
        end
      end
      thread.name = "neverblock-pool"
      thread.report_on_exception = false
      thread
    end

    def next_job
      @lock.synchronize { @idle += 1 }
      job = @queue.pop
      @lock.synchronize do
        @idle -= 1
        @pending -= 1 if job
      end
      job
    end
  end
end
