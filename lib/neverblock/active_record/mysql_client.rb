# frozen_string_literal: true

require_relative "../mysql"

module NeverBlock
  module ActiveRecord
    # What the neverblock_mysql2 and neverblock_trilogy adapters add to the
    # stock adapters' driver clients (by extending each client object; the
    # driver classes are not changed):
    #
    # - the client connects on NeverBlock's thread pool inside NeverBlock:
    #   mysql2's connect blocks the thread, and a Trilogy socket opened on
    #   the loop is one Trilogy dup()s and closes, which leaves io-event's
    #   epoll registration behind (see NeverBlock::MySQL);
    # - a query interrupted by a timeout or a cancel is stopped on the
    #   server with `KILL QUERY` from a short-lived second session (both
    #   drivers drop their socket on such an interrupt, and MariaDB would
    #   run the statement to its end). ActiveRecord then reconnects as it
    #   does after any lost connection.
    module MySQLClient
      # @param connection_class [Class] NeverBlock::MySQL::TrilogyConnection
      #   or Mysql2Connection, for the killing session.
      # @param config [Hash] the adapter's connection options.
      # @yieldreturn [Object] a connected driver client.
      # @return [Object] the client, extended with {KillOnInterrupt}.
      def self.open(connection_class, config)
        client = NeverBlock.neverblocking? ? NeverBlock.defer { yield } : yield
        client.extend(KillOnInterrupt)
        client.neverblock_killer = Killer.new(connection_class, MySQL::Recovery.kill_config(config),
                                              session_id(client))
        client
      end

      # @return [Integer] the server's id of the client's session.
      def self.session_id(client)
        return client.thread_id if client.respond_to?(:thread_id)

        client.query("SELECT CONNECTION_ID()").rows.first.first
      end

      # Sends `KILL QUERY` for one session.
      Killer = Struct.new(:connection_class, :config, :session_id) do
        def call
          MySQL::Recovery.kill_query(connection_class, config, session_id)
        end
      end

      # Extends a driver client: `query` kills its statement on the server
      # when an interrupt (not a driver error) escapes it.
      module KillOnInterrupt
        # @return [Killer]
        attr_accessor :neverblock_killer

        # The driver's query; see {MySQLClient}.
        def query(*args, **options)
          options.empty? ? super(*args) : super
        rescue Exception => e # rubocop:disable Lint/RescueException -- re-raised
          neverblock_killer&.call unless neverblock_driver_error?(e)
          raise
        end

        private

        def neverblock_driver_error?(error)
          neverblock_killer.connection_class.errors.any? { |type| error.is_a?(type) }
        end
      end
    end
  end
end
