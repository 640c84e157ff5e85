# frozen_string_literal: true

require "stringio"

module NeverBlock
  class Server
    # One parsed request: its Rack env (without rack.input until {#finish}),
    # its body as it arrives, and what the connection must know to answer it.
    class Request
      # @return [Hash] the Rack env.
      attr_reader :env

      # @return [String] the (de-chunked) body read so far, binary.
      attr_reader :body

      # @return [Boolean] true once the whole message has been read.
      attr_accessor :complete

      # @return [Boolean] whether HTTP allows the connection to stay open
      #   after this request (llhttp's view: version and Connection header).
      attr_accessor :keep_alive

      # @return [Boolean] true when the client sent `Expect: 100-continue`
      #   and a body is still to come.
      attr_accessor :expects_continue

      # @return [Boolean] true for `HEAD` (the response has no body).
      attr_reader :head

      # @return [Boolean] true for HTTP/1.0.
      attr_reader :http10

      def initialize(env, head:, http10:)
        @env = env
        @body = String.new(encoding: Encoding::BINARY)
        @head = head
        @http10 = http10
        @complete = false
        @keep_alive = false
        @expects_continue = false
      end

      # Finishes the env: rack.input over the body, and CONTENT_LENGTH for a
      # body that came chunked (the app sees it de-chunked).
      # @return [Hash] the env.
      def finish
        if @env.delete("HTTP_TRANSFER_ENCODING")
          @env["CONTENT_LENGTH"] = @body.bytesize.to_s
        end
        @env["rack.input"] = StringIO.new(@body)
        @env["rack.response_finished"] = []
        @env
      end
    end
  end
end
