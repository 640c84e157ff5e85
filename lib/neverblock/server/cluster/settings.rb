# frozen_string_literal: true

module NeverBlock
  class Server
    class Cluster
      # How the master looks after its workers: when one counts as hung,
      # and when one is replaced for its memory or its age. {Server#initialize}
      # builds it from its options (so a bad value fails there, not in the
      # master later); {Cluster} and {Worker} read it.
      #
      # - `worker_timeout` :: seconds a worker's event loop may go without
      #   turning (a request computing in `loop {}`, a C call holding the
      #   GVL, a deadlock) before the master kills and replaces it, after
      #   asking it to log its tasks (default 60, like Puma's; nil: never).
      #   A loop that waits for IO turns: only one held by a fiber counts.
      # - `worker_boot_timeout` :: seconds a new worker may take to boot and
      #   accept (default: `worker_timeout`).
      # - `max_requests` :: requests after which a worker is replaced, the
      #   new one booted first (default nil: never).
      # - `max_requests_jitter` :: up to this many more, drawn per worker, so
      #   that workers started together are not replaced together (default
      #   a tenth of `max_requests`).
      # - `max_memory` :: bytes of memory (`memory_metric`) above which a
      #   worker is replaced, the new one booted first (default nil: never).
      # - `memory_metric` :: `:rss` (the default: resident pages, counting
      #   those shared with the master) or `:pss` (shared pages divided among
      #   their sharers: what `--preload`ed workers really cost; reading it
      #   costs the master more).
      # - `supervise` :: commands the master keeps running beside its
      #   workers ({Sidecars}), like Solid Queue's `bin/jobs` (default none).
      # - `control` :: `tcp://HOST:PORT` or `unix://PATH` where the master
      #   answers `/metrics`, `/stats`, `/tasks` and commands ({Control};
      #   default nil: none), `control_token` the token a TCP one wants
      #   (default: one is made and logged).
      # - `refork_after` :: request counts (`[50, 100, 1000]`): when a worker
      #   of the current generation has served the first, it is promoted to
      #   mold and the next generation is forked from it ({Refork}); the
      #   second counts for that generation, and so on; the last repeats for
      #   every later generation, unless it is `false` (`[50, false]`: one
      #   refork), as in Pitchfork (default empty: none; `neverblock ctl
      #   refork` and `URG` promote one at any time).
      # - `refork_when` :: a callable that says whether a worker is warm
      #   (`->(index) { Rails.cache.warm? }`): each worker calls it with its
      #   index, in its loop, every {#heartbeat_interval} until it returns
      #   true, and tells the master; a worker is then promoted only once it
      #   reached its `refork_after` count and is warm, and `URG` picks a
      #   warm one if there is one (default nil: every worker counts as warm).
      Settings = Struct.new(:worker_timeout, :worker_boot_timeout, :max_requests, :max_requests_jitter,
                            :max_memory, :memory_metric, :supervise, :control, :control_token, :refork_after,
                            :refork_when, keyword_init: true) do
        # @param options [Hash] any of the members.
        # @return [Settings] frozen, with defaults filled in.
        # @raise [ArgumentError] for an invalid value.
        def self.build(worker_timeout: 60, worker_boot_timeout: nil, max_requests: nil, max_requests_jitter: nil,
                       max_memory: nil, memory_metric: :rss, supervise: [], control: nil, control_token: nil,
                       refork_after: nil, refork_when: nil)
          worker_timeout = nil if worker_timeout == false
          positive!(worker_timeout, :worker_timeout) if worker_timeout
          worker_boot_timeout ||= worker_timeout
          positive!(worker_boot_timeout, :worker_boot_timeout) if worker_boot_timeout
          NeverBlock.validate_size!(max_requests, :max_requests) if max_requests
          max_requests_jitter ||= max_requests ? max_requests / 10 : 0
          NeverBlock.validate_size!(max_requests_jitter, :max_requests_jitter, minimum: 0)
          NeverBlock.validate_size!(max_memory, :max_memory) if max_memory
          unless %i[rss pss].include?(memory_metric)
            raise ArgumentError, "memory_metric must be :rss or :pss, got #{memory_metric.inspect}"
          end

          raise ArgumentError, "refork_when must respond to call, got #{refork_when.inspect}" unless refork_when.nil? || refork_when.respond_to?(:call)

          supervise = Array(supervise).map { |command| command.is_a?(Array) ? command.map(&:to_s).freeze : command.to_s }
          Sidecars.new(supervise) # raises for an empty command

          new(worker_timeout: worker_timeout, worker_boot_timeout: worker_boot_timeout, max_requests: max_requests,
              max_requests_jitter: max_requests_jitter, max_memory: max_memory, memory_metric: memory_metric,
              supervise: supervise.freeze, control: control && control_url!(control),
              control_token: control_token&.to_s, refork_after: refork_after!(refork_after), refork_when: refork_when).freeze
        end

        # @return [Array<Integer, false>] `counts` (nil, false or [] for none),
        #   each a positive Integer, the last possibly `false`, on a platform
        #   that can refork.
        # @raise [ArgumentError] otherwise.
        def self.refork_after!(counts)
          counts = [] if counts.nil? || counts == false
          counts = Array(counts)
          unless counts[0...-1].all? { |count| count.is_a?(Integer) && count.positive? } &&
                 (counts.empty? || counts.last == false || (counts.last.is_a?(Integer) && counts.last.positive?))
            raise ArgumentError, "refork_after must be request counts above 0, the last may be false, like [50, 1000], " \
                                 "got #{counts.inspect}"
          end
          counts = [] if counts == [false]
          raise ArgumentError, "refork_after: #{Refork.unavailable}" if counts.any? && Refork.unavailable

          counts.freeze
        end
        private_class_method :refork_after!

        def self.positive!(seconds, name)
          NeverBlock.validate_timeout!(seconds, name)
          raise ArgumentError, "#{name} must be more than 0 seconds (nil turns it off), got #{seconds.inspect}" if seconds.zero?
        end
        private_class_method :positive!

        # @return [String] `url`, when it is `tcp://HOST:PORT` or `unix://PATH`.
        # @raise [ArgumentError] otherwise.
        def self.control_url!(url)
          url = url.to_s
          return url if url.match?(%r{\Atcp://[^/]+:\d+\z}) || url.match?(%r{\Aunix://.+\z})

          raise ArgumentError, "control must look like tcp://127.0.0.1:9293 or unix:///path/to/control.sock, got #{url.inspect}"
        end
        private_class_method :control_url!

        # @return [Float] seconds between a worker's heartbeats: often enough
        #   that a quarter of `worker_timeout` passes between two, at most one
        #   a second (they also carry its request count for `max_requests`).
        def heartbeat_interval
          return 1.0 unless worker_timeout

          (worker_timeout / 4.0).clamp(0.05, 1.0)
        end

        # @return [Integer, nil] the request count after which a new worker
        #   is replaced: `max_requests` plus its jitter.
        def draw_max_requests
          max_requests && max_requests + rand(0..max_requests_jitter)
        end
      end
    end
  end
end
