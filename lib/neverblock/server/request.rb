# frozen_string_literal: true

require "stringio"
require "tempfile"
require_relative "empty_input"

module NeverBlock
  class Server
    # One parsed request: its Rack env (without rack.input until {#complete_env}),
    # its body as it arrives, and what the connection must know to answer it.
    #
    # A body up to `max_body_in_memory` bytes is kept in a String; a larger
    # one is written to a Tempfile, unlinked at once (nothing is left on
    # disk even if the process dies) and closed by {#close} once the
    # request is answered.
    class Request
      # @return [Hash] the Rack env.
      attr_reader :env

      # @return [String, nil] the (de-chunked) body read so far, binary; nil
      #   when there is none yet or it went to a file ({#spooled?}).
      attr_reader :body

      # @return [Integer] bytes of (de-chunked) body read so far.
      attr_reader :body_bytes

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

      # @return [Float, nil] when its head was complete (monotonic seconds),
      #   where `request_timeout` counts from; set only when that is on.
      attr_accessor :head_at

      # Positional arguments: the parser makes one per request, and
      # keywords through Class#new would allocate a Hash each time.
      # @param env [Hash]
      # @param head [Boolean], http10 [Boolean] see {#head}, {#http10}.
      # @param max_body_in_memory [Integer] bytes of body kept in a String.
      def initialize(env, head, http10, max_body_in_memory = 64 * 1024)
        @env = env
        @body = nil
        @body_bytes = 0
        @file = nil
        @max_body_in_memory = max_body_in_memory
        @head = head
        @http10 = http10
        @complete = false
        @keep_alive = false
        @expects_continue = false
        @head_at = nil
      end

      # Appends (de-chunked) body bytes, moving the body to a Tempfile when
      # it grows over `max_body_in_memory`.
      # @param chunk [String]
      # @return [void]
      # @raise [SystemCallError] when the Tempfile cannot be created or written.
      #
      # Called inside llhttp's parse of the connection's read buffer, which
      # the server shares between connections: nothing here may wait (a
      # file write can, with the io_uring selector). Chunks bound for the
      # Tempfile are kept and written by {#flush_body} once the parse is over.
      def append_body(chunk)
        @body_bytes += chunk.bytesize
        if @file || @body_bytes > @max_body_in_memory
          (@unwritten ||= []) << chunk
        elsif @body
          @body << chunk
        else
          @body = chunk.b
        end
      end

      # @api private
      # Writes the body chunks parsed since the last call to the Tempfile
      # (opening it when the body just outgrew memory). Called by the
      # {Parser} after each parse, outside llhttp's callbacks.
      # @return [void]
      def flush_body
        chunks = @unwritten or return
        @unwritten = nil
        spool unless @file
        chunks.each { |chunk| @file.write(chunk) }
      end

      # @return [Boolean] true when the body went to a Tempfile.
      def spooled?
        !@file.nil?
      end

      # Finishes the env: rack.input over the body (a StringIO, the rewound
      # Tempfile, or for a request without one the shared {EmptyInput}), and
      # CONTENT_LENGTH for a body that came chunked (the app sees it
      # de-chunked).
      # @return [Hash] the env.
      def complete_env
        if @env.delete("HTTP_TRANSFER_ENCODING")
          @env["CONTENT_LENGTH"] = @body_bytes.to_s
        end
        if @file
          @file.rewind
          @env["rack.input"] = @file
        else
          @env["rack.input"] = @body ? StringIO.new(@body) : EmptyInput::INSTANCE
        end
        @env["rack.response_finished"] = []
        @env
      end

      # Closes the spooled body's file, if any (the connection calls it once
      # the request is answered or abandoned). Safe to call twice.
      # @return [void]
      def close
        file = @file
        return unless file

        @file = nil
        file.close unless file.closed?
      end

      private

      def spool
        file = Tempfile.create("neverblock-body")
        begin
          File.unlink(file.path)
          file.binmode
          file.write(@body) if @body
        rescue StandardError
          file.close
          raise
        end
        @file = file
        @body = nil
      end
    end
  end
end
