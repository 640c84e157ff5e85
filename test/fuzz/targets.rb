# frozen_string_literal: true

module NeverBlockFuzz
  # A broken invariant in a case (the target's message says which); the
  # worker exits with it, and bin/fuzz keeps the case's input.
  class Failure < StandardError; end

  # What the fuzzer can run, by the name `bin/fuzz --target` takes. Each
  # target is a class made with a Mutator, whose #call(random, recorder)
  # runs one case, #report returns counters, and #repeat(inputs, times)
  # runs the same work over and over for the leak check (see Worker).
  module Targets
    # What every target shares: its Mutator, its counters, and the base env
    # a server gives the head parser.
    class Target
      # The base env of NeverBlock::Server's connections (as Connection#base_env builds it).
      SERVER_ENV = { "SCRIPT_NAME" => "", "REMOTE_ADDR" => "127.0.0.1", "rack.url_scheme" => "http",
                     "rack.early_hints" => :early_hints, "SERVER_SOFTWARE" => "NeverBlock" }.freeze

      # @param mutator [Mutator] makes each case's input.
      def initialize(mutator)
        @mutator = mutator
        @counts = Hash.new(0)
      end

      # @return [Hash] counters for the summary.
      def report
        @counts
      end
    end

    NAMES = {
      "http_head" => ["targets/http_head", :HTTPHead], # NeverBlock::HTTPHead#parse
      "parser" => ["targets/parser", :Parser],         # NeverBlock::Server::Parser#<<, with and without it
      "epoll" => ["targets/epoll", :Epoll],            # NeverBlock::Epoll
      "response_head" => ["targets/response_head", :ResponseHead] # HTTPHead.response_headers beside Response#add_headers
    }.freeze

    # @param name [String] one of NAMES' keys.
    # @return [Class]
    def self.load(name)
      file, constant = NAMES.fetch(name)
      require_relative file
      const_get(constant)
    end
  end
end
