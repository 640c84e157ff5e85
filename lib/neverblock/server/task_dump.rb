# frozen_string_literal: true

module NeverBlock
  class Server
    # What a serving process's tasks are doing, as text for the log and
    # `neverblock ctl tasks`, grouped by kind, each task with where it comes
    # from and its backtrace:
    #
    # - requests in flight: the request (method, target, client) and its task;
    # - children: tasks with a parent (what a request or another task
    #   spawned), with that parent and where their block is;
    # - detached: roots that are not the server's own (what the app spawned
    #   with `detached: true`, with where it spawned it, its `Fiber.schedule`
    #   fibers);
    #
    # then a count of the server's own tasks (accept loops, timers, the
    # tasks of connections without a request in flight). The task holding
    # the loop, if one does, comes first in its group, and is shown even
    # when it is the server's own. {Server#task_dump} makes one on `SIGQUIT` (a worker's, or
    # the master's, which passes it on) and for the control listener's
    # `/tasks`; the master's watchdog asks a hung worker for one before it
    # kills it ({Cluster}).
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
      # @param serving [Task, nil] the task running the server itself
      #   ({Server#serve_here}): the server's own, whatever its kind.
      def initialize(scheduler, connections, serving = nil)
        @scheduler = scheduler
        @connections = connections
        @serving = serving
      end

      # @return [String] the report, several lines.
      def to_s
        @running = @scheduler.running
        @running = nil if @running.equal?(Fiber.current) # made in the loop itself (/tasks)
        tasks = @scheduler.tasks
        @requests = requests(tasks)
        children, detached = tasks.reject { |task| @requests.key?(task) || task.equal?(@serving) }
                                  .select { |task| task.parent || !task.internal? }
                                  .partition(&:parent)
        own = tasks.size - @requests.size - children.size - detached.size
        lines = [summary(tasks.size, children.size, detached.size, own)]
        group(lines, "requests in flight", @requests.keys) { |task| request(@requests.fetch(task), task) }
        group(lines, "children", children) { |task| "#{task.inspect}, child of #{parent(task.parent)}" }
        group(lines, "detached", detached) { |task| AppTasks.describe(task) }
        if @running && [@requests.keys, children, detached].none? { |listed| listed.any? { |task| holds?(task) } }
          holder = tasks.find { |task| holds?(task) }
          lines << "#{(holder || @running).inspect} (the server's own) holds the loop:"
          lines.concat(frames(@scheduler.thread.backtrace))
        end
        lines.join("\n")
      end

      private

      # @return [Hash{Task => Connection}] the tasks of requests in flight.
      def requests(tasks)
        by_fiber = tasks.each_with_object({}.compare_by_identity) { |task, all| all[task.fiber] = task if task.fiber }
        @connections.each_with_object({}.compare_by_identity) do |connection, requests|
          next unless connection.request_env

          task = by_fiber[connection.fiber]
          requests[task] = connection if task
        end
      end

      def summary(count, children, detached, own)
        "#{count} tasks: #{@requests.size} requests in flight, #{children} children, #{detached} detached, " \
          "#{own} the server's own; #{@connections.size} connections; " \
          "#{@running ? 'the loop is held by the task marked below' : 'the loop is not held (it waits for IO or timers)'}"
      end

      # Adds a heading and each task (the one holding the loop first) with
      # its backtrace.
      def group(lines, heading, tasks)
        return if tasks.empty?

        lines << "#{heading} (#{tasks.size}):"
        tasks.sort_by { |task| holds?(task) ? 0 : 1 }.each do |task|
          holds = holds?(task)
          lines << "  #{yield(task)}, #{holds ? 'holds the loop' : 'waits'}:"
          lines.concat(frames(holds ? @scheduler.thread.backtrace : task.fiber&.backtrace))
        end
      end

      def holds?(task)
        !@running.nil? && task.fiber.equal?(@running)
      end

      def request(connection, task)
        env = connection.request_env || {} # (it may have ended since)
        query = env["QUERY_STRING"].to_s
        "#{env['REQUEST_METHOD']} #{env['PATH_INFO']}#{"?#{query}" unless query.empty?} from #{env['REMOTE_ADDR']}, in #{task.inspect}"
      end

      def parent(task)
        connection = @requests[task]
        return task.inspect unless connection

        env = connection.request_env || {}
        "the request #{env['REQUEST_METHOD']} #{env['PATH_INFO']}"
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
