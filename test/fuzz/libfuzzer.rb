# frozen_string_literal: true

require "digest"
require "fileutils"
require_relative "corpus"

module NeverBlockFuzz
  # The libFuzzer worker: test/fuzz/http_head_libfuzzer.c, built by bin/fuzz,
  # run beside the Ruby workers for the same time (see Run). It starts from
  # the same seeds (Corpus), each behind the harness's three parameter bytes
  # (the fuzz test's limits, the server's base env), with the Corpus tokens
  # as its dictionary, and keeps the inputs that reached new code in
  # tmp/fuzz/libfuzzer/corpus, which later runs start from too.
  class LibFuzzer
    # The harness's parameter bytes for a seed: no tiny limit, the server's
    # base env, no extra offset.
    PARAMETERS = "\x00\x00\x01".b.freeze

    # @param binary [String] the built harness.
    # @param out [String] bin/fuzz's output directory (tmp/fuzz).
    def initialize(binary, out)
      @binary = binary
      @dir = File.join(out, "libfuzzer")
      @out = out
    end

    # Writes the seeds and the dictionary for this run's seed.
    # @return [Array<String>] the command that fuzzes for `seconds`.
    def command(seconds, seed)
      corpus = File.join(@dir, "corpus")
      seeds = File.join(@dir, "seeds")
      dictionary = File.join(@dir, "http.dict")
      write_seeds(seeds, dictionary, seed)
      FileUtils.mkdir_p(corpus)
      # libFuzzer's own leak check is off: Ruby keeps its heap in mmap'd
      # pages that LeakSanitizer does not scan, so every Ruby object
      # looks leaked (the Ruby workers' leak check covers the extension).
      [@binary, "-max_total_time=#{seconds.ceil}", "-seed=#{(seed % 0x7fffffff) + 1}", "-detect_leaks=0",
       "-timeout=10", "-print_final_stats=1", "-dict=#{dictionary}", "-artifact_prefix=#{@out}/libfuzzer-",
       corpus, seeds]
    end

    # @param log [String] the harness's stderr.
    # @return [String] what it did, in a line.
    def summary(log)
      done = log[/^#\d+\s+DONE\s+.*$/] || log.lines.grep(/^#\d+/).last.to_s.strip
      runs = log[/^Done (\d+) runs in (\d+) second/] && "#{Regexp.last_match(1)} runs in #{Regexp.last_match(2)} s"
      "#{runs}; #{done.sub(/\A#\d+\s+DONE\s+/, '')}"
    end

    # @param log [String] the harness's stderr.
    # @return [String, nil] the input it wrote when it failed.
    def artifact(log)
      log[/Test unit written to (\S+)/, 1]
    end

    private

    def write_seeds(seeds, dictionary, seed)
      FileUtils.rm_rf(seeds)
      FileUtils.mkdir_p(seeds)
      inputs, tokens = Corpus.load(Random.new(seed))
      inputs.each do |input|
        data = PARAMETERS + input
        File.binwrite(File.join(seeds, Digest::SHA1.hexdigest(data)), data)
      end
      File.write(dictionary, tokens.select { |token| token.bytesize <= 64 }.map { |token| "#{quote(token)}\n" }.join)
    end

    # A dictionary entry: the token in double quotes, every byte that is not
    # printable ASCII (and `"`, `\`) as \xNN.
    def quote(token)
      %("#{token.bytes.map { |byte| byte.between?(32, 126) && byte != 34 && byte != 92 ? byte.chr : format('\\x%02X', byte) }.join}")
    end
  end
end
