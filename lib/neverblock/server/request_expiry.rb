# frozen_string_literal: true

module NeverBlock
  class Server
    # What a request's deadline raises, and the record that it did. Exchange
    # passes it to Scheduler#timeout_after in place of an exception class:
    # when the deadline passes while the request waits, the scheduler calls
    # #exception, which makes the {RequestTimeout} it raises in the
    # request's fiber and keeps it. So the exchange knows, exactly and
    # without looking at a clock, that its request was interrupted, even
    # when the app rescued the expiry and answered itself. A request in time
    # makes no exception; one object serves each of a connection's requests
    # in turn (#clear between them), in that connection's fiber only.
    class RequestExpiry
      # @return [RequestTimeout, nil] the expiry raised in the request since
      #   the last #clear (nil: its deadline interrupted nothing).
      attr_reader :error

      def initialize
        @error = nil
      end

      # Forgets the expiry of the request before, or one already reported.
      # @return [self]
      def clear
        @error = nil
        self
      end

      # Called by the scheduler (the Exception protocol `raise` and
      # timeout_after use) when the deadline fires.
      # @param seconds [Numeric] the `request_timeout`.
      # @return [RequestTimeout] the error to raise, kept as #error.
      def exception(seconds)
        @error = RequestTimeout.new(seconds)
      end
    end
  end
end
