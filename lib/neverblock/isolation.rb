# frozen_string_literal: true

module NeverBlock
  # @api private
  # The SQL standard's isolation levels, shared by the PostgreSQL and MySQL
  # clients' `transaction(isolation:)`.
  module Isolation
    # isolation: keyword => the SQL words for it.
    LEVELS = {
      serializable: "SERIALIZABLE", repeatable_read: "REPEATABLE READ", read_committed: "READ COMMITTED",
      read_uncommitted: "READ UNCOMMITTED"
    }.freeze

    # @param level [Symbol]
    # @return [String] e.g. "REPEATABLE READ".
    # @raise [ArgumentError] for an unknown level.
    def self.sql(level)
      LEVELS.fetch(level) do
        raise ArgumentError, "unknown isolation #{level.inspect}; use one of #{LEVELS.keys.join(', ')}"
      end
    end
  end
end
