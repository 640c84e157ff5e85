# frozen_string_literal: true

module NeverBlock
  class Server
    # What a serving process's tasks are doing, as text for the log: the
    # task that holds the event loop (if one does) and every request in
    # flight, each with its backtrace, then a count of the rest (idle
    # connections, the server's own tasks). {Server#task_dump} makes one on
    # `SIGQUIT` (a worker's, or the master's, which passes it on), and the
    # master's watchdog asks a hung worker for one before it kills it
    # ({Cluster}).
    #
    # It is made on a thread of its own, not the loop's: the loop may be
    # stuck, which is when a dump matters. So it only reads the loop's
    # state, each collection copied in one call (which the GVL makes
    # atomic), and a fiber's backtrace is taken while it is suspended (the
    # one holding the loop's, from the loop thread's backtrace).
    class TaskDump
      # Frames shown of each backtrace (a Rails request's runs to hundreds).
      FRAMES = 25

      # @param scheduler [Scheduler] the serving loop's.
      # @param connections [Array<Connection>] the server's open connections.
      def initialize(scheduler, connections)
        @scheduler = scheduler
        @connections = connections
      end

      # @return [String] the report, several lines.
      def to_s
        running = @scheduler.running
        running = nil if running.equal?(Fiber.current) # made in the loop itself (neverblock ctl tasks)
        tasks = @scheduler.tasks
        busy = @connections.select(&:request_env)
        lines = ["#{tasks.size} tasks, #{@connections.size} connections, #{busy.size} requests in flight; " \
                 "#{running ? 'the loop is held by the first one below' : 'the loop is not held (it waits for IO or timers)'}"]
        busy = busy.sort_by { |connection| connection.fiber.equal?(running) ? 0 : 1 }
        busy.each { |connection| lines.concat(request(connection, running, tasks)) }
        if running && busy.none? { |connection| connection.fiber.equal?(running) }
          task = tasks.find { |candidate| candidate.fiber.equal?(running) }
          lines << "#{(task || running).inspect} holds the loop:"
          lines.concat(frames(@scheduler.thread.backtrace))
        end
        lines.join("\n")
      end

      private

      def request(connection, running, tasks)
        env = connection.request_env
        fiber = connection.fiber
        task = tasks.find { |candidate| candidate.fiber.equal?(fiber) }
        holds = fiber.equal?(running)
        query = env["QUERY_STRING"].to_s
        target = "#{env['PATH_INFO']}#{"?#{query}" unless query.empty?}"
        head = "#{env['REQUEST_METHOD']} #{target} from #{env['REMOTE_ADDR']}, in #{(task || fiber).inspect},"
        backtrace = holds ? @scheduler.thread.backtrace : fiber&.backtrace
        [holds ? "#{head} holds the loop:" : "#{head} waits:", *frames(backtrace)]
      end

      def frames(backtrace)
        backtrace ||= []
        shown = backtrace.first(FRAMES).map { |frame| "    #{frame}" }
        shown << "    ... #{backtrace.size - FRAMES} more" if backtrace.size > FRAMES
        shown
      end
    end
  end
end
