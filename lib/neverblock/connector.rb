# frozen_string_literal: true

module NeverBlock
  # Opens connections for a {ConnectionPool}, retrying a server that is down
  # or starting up with exponential backoff, a bounded number of times, and
  # giving up at once on errors that retrying cannot fix. Either way the
  # caller gets a {ConnectError} that names the server and the attempts.
  #
  #   connector = NeverBlock::Connector.new("postgres://db:5432/app",
  #                                         retryable: ->(error) { error.message.include?("refused") }) do
  #     PG.connect(dbname: "app", host: "db")
  #   end
  #   connector.call # => a connection, or ConnectError
  #
  # The waits between attempts are `sleep`, so inside NeverBlock they
  # suspend only the connecting fiber.
  class Connector
    # @return [Integer] attempts after the first one.
    attr_reader :retries

    # @param target [String, #call] the server, for messages (no password
    #   in it); or a callable that returns it, called only when a message
    #   is made (the driver's defaults, such as environment variables, are
    #   then read as the driver reads them, when it connects).
    # @param errors [Array<Class>] the driver's connection errors: others
    #   propagate untouched.
    # @param retryable [#call] true for an error worth another attempt.
    # @param retries [Integer] attempts after the first (>= 0).
    # @param backoff [Numeric] seconds before the first retry; doubles each
    #   time (with up to 25 % jitter so that many processes do not retry in
    #   step), at most 2 s.
    # @yieldreturn [Object] a new connection.
    def initialize(target, errors:, retryable:, retries: 3, backoff: 0.1, &open)
      raise ArgumentError, "Connector.new needs a block that opens a connection" unless open
      raise ArgumentError, "retries must be an Integer >= 0, got #{retries.inspect}" unless retries.is_a?(Integer) && retries >= 0

      @target = target
      @errors = errors
      @retryable = retryable
      @retries = retries
      @backoff = NeverBlock.validate_timeout!(backoff, :backoff)
      @open = open
    end

    # Opens one connection.
    # @return [Object] the connection.
    # @raise [ConnectError] when every attempt failed or a failure was final.
    def call
      started = Clock.now
      attempt = 0
      begin
        attempt += 1
        @open.call
      rescue *@errors => e
        unless @retryable.call(e)
          raise ConnectError, "cannot connect to #{target} (not retried): #{first_line(e)}"
        end
        if attempt <= @retries
          sleep(delay(attempt))
          retry
        end
        elapsed = Clock.now - started
        raise ConnectError, "cannot connect to #{target}: #{attempt} attempt#{'s' unless attempt == 1} in " \
                            "#{format('%.1f', elapsed)} s failed; last error: #{first_line(e)}"
      end
    end

    # @return [String]
    def inspect
      "#<#{self.class.name} #{target} retries=#{@retries}>"
    end

    # @return [String] the server, for messages.
    def target
      @target.respond_to?(:call) ? @target.call : @target
    end

    private

    MAX_DELAY = 2.0
    private_constant :MAX_DELAY

    def delay(attempt)
      base = [@backoff * (2**(attempt - 1)), MAX_DELAY].min
      base + (base * 0.25 * rand)
    end

    def first_line(error)
      error.message.to_s.strip.lines.first.to_s.strip
    end
  end
end
