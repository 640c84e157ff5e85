# frozen_string_literal: true

module NeverBlock
  class Debouncer
    # What an upstream call produced, as a store hands it to followers (and,
    # with a ttl, to later identical requests). One of:
    # - a {Response}: share it;
    # - a {Failure}: answer with its 502 or 504;
    # - {PASS}: the response is not shareable (it sets a cookie, is private,
    #   varies on `*`, or its body is larger than `max_body`): each follower
    #   calls the app itself.
    module Outcome
      # Followers go upstream themselves.
      PASS = :pass

      # A complete response that followers may share: status, frozen headers
      # and the whole body as one frozen String.
      class Response
        # @return [Integer]
        attr_reader :status
        # @return [Hash{String => String, Array<String>}] frozen.
        attr_reader :headers
        # @return [String] frozen.
        attr_reader :body
        # @return [Hash{String => String, nil}, nil] for a response with a
        #   Vary header: the leader's value of each header it names.
        attr_reader :vary

        # @param status [Integer]
        # @param headers [Hash]
        # @param body [String]
        # @param vary [Hash{String => String, nil}, nil]
        def initialize(status, headers, body, vary: nil)
          @status = status
          @headers = headers.to_h { |name, value| [name.dup.freeze, value.frozen? ? value : value.dup.freeze] }.freeze
          @body = body.frozen? ? body : body.dup.freeze
          @vary = vary&.freeze
        end

        # @param env [Hash]
        # @return [Boolean] false when the request's values of the Vary
        #   headers differ from the leader's, so this response is not its answer.
        def matches?(env)
          @vary.nil? || Key.values(@vary.keys, env) == @vary
        end

        # @param role [String] `leader`, `follower` or `hit`, for X-Debounce.
        # @return [Array] a new Rack response; the headers are a fresh Hash.
        def to_rack(role)
          [@status, @headers.merge(HEADER => role), [@body]]
        end

        # @return [Integer] bytes held, roughly.
        def bytesize
          @body.bytesize + @headers.sum { |name, value| name.bytesize + Array(value).sum(&:bytesize) }
        end
      end

      # The upstream call failed (the app raised) or took too long: every
      # follower gets this status. Never stored.
      class Failure
        # @return [Integer] 502 or 504.
        attr_reader :status
        # @return [String]
        attr_reader :message

        # @param status [Integer]
        # @param message [String]
        def initialize(status, message)
          @status = status
          @message = "#{message}\n".freeze
        end

        # @param role [String]
        # @return [Array] a Rack response.
        def to_rack(role)
          [@status, { "content-type" => "text/plain", "content-length" => @message.bytesize.to_s, HEADER => role },
           [@message]]
        end
      end
    end
  end
end
