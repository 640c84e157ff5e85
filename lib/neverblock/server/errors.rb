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

    # Raised inside the app, at its next wait, when its request outlives
    # `request_timeout` (see {Limits}); the server then answers 503. Like
    # the expiry of {NeverBlock.timeout} (whose internal error it extends)
    # it is a RuntimeError and not a Timeout::Error: code that rescues
    # Timeout::Error for timeouts of its own (Net::HTTP's retry) does not
    # take it for one, while `rescue => e` cleanup still runs. An app may
    # rescue it and answer itself; that answer is sent.
    class RequestTimeout < TimeoutError::Expired
      # @param seconds [Numeric] the `request_timeout`.
      def initialize(seconds)
        super("request_timeout of #{seconds} s expired")
      end
    end

    # Raised by {Server#run} in a preforking master when workers keep
    # exiting before they are ready (the app fails to boot in them).
    class BootError < BaseError; end
  end
end
