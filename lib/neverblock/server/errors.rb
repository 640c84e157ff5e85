# frozen_string_literal: true

module NeverBlock
  class Server
    # A request the server refuses with an HTTP error status (400, 408, 413,
    # 414, 431, 505) before the app sees it; the connection is then closed.
    class HTTPError < BaseError
      # @return [Integer] the response status.
      attr_reader :status

      # @param status [Integer]
      # @param message [String] for the log; never sent to the client.
      def initialize(status, message)
        @status = status
        super(message)
      end
    end

    # Raised by {Server#run} in a preforking master when workers keep
    # exiting before they are ready (the app fails to boot in them).
    class BootError < BaseError; end
  end
end
