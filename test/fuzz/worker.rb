# frozen_string_literal: true

# One fuzzing process: a target's cases, one after another, until its time
# is up. test/fuzz/run.rb starts one per target (bin/fuzz runs that under
# the sanitizers) and reads what this one recorded if it dies.
#
#   ruby test/fuzz/worker.rb TARGET SEED SECONDS STATE_FILE [CASE]
#
# Case N is made from Random.new(SEED * 2**32 + N) and the seeds (the test
# files' literals, the generator's cases from SEED), nothing else: with
# CASE, only that case runs, which replays it. Before the cases, a leak
# check (#leak_check) repeats the target's plain work and measures what
# stays allocated. Prints a JSON summary on stdout; on a broken invariant
# or an unexpected exception, prints it on stderr and exits 1.
require "json"
require_relative "sanitizer"
require_relative "corpus"
require_relative "mutator"
require_relative "bounded_string"
require_relative "recorder"
require_relative "targets"

module NeverBlockFuzz
  class Worker
    # The leak check: runs of the repeated work, first to warm caches up
    # (the fstring table, Ruby's heap pages), then measured.
    LEAK_WARMUP = 3_000
    LEAK_RUNS = 20_000
    # What may stay allocated after LEAK_RUNS (bytes): heap pages Ruby
    # keeps; a leak of one object per run is several times this.
    LEAK_SLACK = 1 << 20

    # @param target [String] a Targets::NAMES key.
    # @param seed [Integer]
    # @param seconds [Numeric] the time budget, loading included.
    # @param state [String] the Recorder's file.
    # @param only [Integer, nil] the one case to run.
    def initialize(target, seed, seconds, state, only = nil)
      @started = now
      @name = target
      @seed = seed
      @seconds = seconds
      @only = only
      @recorder = Recorder.new(state)
      seeds, tokens = Corpus.load(Random.new(seed))
      @seeds = seeds
      @target = Targets.load(target).new(Mutator.new(seeds, tokens))
    end

    # @return [Hash] the summary.
    def run
      extension = check_extension
      if @only
        run_case(@only)
        cases = 1
      else
        leak = leak_check
        cases = run_cases
      end
      { target: @name, seed: @seed, cases: cases, seconds: (now - @started).round(1), extension: extension,
        leak: leak, counts: @target.report.sort_by { |key, _| key.to_s }.to_h }
    end

    private

    def run_cases
      deadline = @started + @seconds
      number = 0
      while now < deadline
        run_case(number)
        number += 1
      end
      number
    end

    def run_case(number)
      @recorder.start(number)
      @target.call(Random.new((@seed << 32) + number), @recorder)
    end

    # The extensions loaded must be the ones bin/fuzz built (it says where
    # in NEVERBLOCK_FUZZ_EXT): a build without the sanitizers would find
    # nothing.
    # @return [Array<String>] their paths.
    def check_extension
      loaded = $LOADED_FEATURES.grep(%r{/neverblock/(?:http_head|epoll)\.so\z})
      raise Failure, "no NeverBlock extension loaded" if loaded.empty?

      expected = ENV.fetch("NEVERBLOCK_FUZZ_EXT", nil)
      stray = expected ? loaded.reject { |path| path.start_with?("#{expected}/") } : []
      raise Failure, "loaded #{stray.join(', ')}, not the build in #{expected}" unless stray.empty?

      loaded
    end

    # Repeats the target's plain work (parsing the first seeds; opening and
    # closing sets) and checks that no memory (ASan's count of allocated
    # bytes) or descriptor stays behind: the extensions allocate through
    # Ruby, so a leak is an object or a descriptor never freed, which
    # LeakSanitizer (off: Ruby itself leaks at exit) would not name.
    # @return [Hash] the growth measured.
    def leak_check
      inputs = @seeds.first(64)
      @target.repeat(inputs, LEAK_WARMUP)
      before = settled_bytes
      fds = open_fds
      @target.repeat(inputs, LEAK_RUNS)
      after = settled_bytes
      result = { runs: LEAK_RUNS, bytes: after && after - before, descriptors: open_fds - fds }
      raise Failure, "#{result[:descriptors]} descriptors left open after #{LEAK_RUNS} runs" if result[:descriptors].positive?
      if after && after - before > LEAK_SLACK
        raise Failure, "#{after - before} bytes more allocated after #{LEAK_RUNS} runs (a leak?)"
      end

      result
    end

    def settled_bytes
      3.times { GC.start(full_mark: true, immediate_sweep: true) }
      Sanitizer.allocated_bytes
    end

    def open_fds
      Dir.children("/proc/self/fd").size
    end

    def now
      Process.clock_gettime(Process::CLOCK_MONOTONIC)
    end
  end
end

if $PROGRAM_NAME == __FILE__
  target, seed, seconds, state, only = ARGV
  begin
    worker = NeverBlockFuzz::Worker.new(target, Integer(seed), Float(seconds), state, only && Integer(only))
    puts JSON.generate(worker.run)
  rescue SignalException, SystemExit
    raise
  rescue Exception => e # rubocop:disable Lint/RescueException -- a SystemStackError or NoMemoryError is a finding too
    warn "#{e.class}: #{e.message}\n  #{e.backtrace&.first(12)&.join("\n  ")}"
    exit 1
  end
end
